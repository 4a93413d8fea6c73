"""Registry data in JetStream KV: adapter records and trusted signer keys."""

import uuid
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import ensure_replicas
from shared.catalog import record_key
from shared.errors import ServiceUnavailable
from shared.schemas import AdapterRecord, AdminAudit, SignerRecord


async def open_bucket(js: JetStreamContext, name: str, replicas: int | None = None) -> KeyValue:
    """A registry KV bucket (file storage, 5 revisions, ``LF_JETSTREAM_REPLICAS`` copies), created when
    missing; one made with another replica count is brought to this one."""
    wanted = await ensure_replicas(js, f"KV_{name}", replicas)
    config = KeyValueConfig(bucket=name, history=5, storage=StorageType.FILE, replicas=wanted)
    kv = await js.create_key_value(config=config)
    await ensure_replicas(js, f"KV_{name}", wanted, check=True)
    return kv


async def load_all(kv: KeyValue, keys: str = ">") -> dict[str, bytes]:
    """Every live key's value (of those ``keys`` matches), streamed by one watcher (one round trip,
    not one per key)."""
    values: dict[str, bytes] = {}
    watcher = await kv.watch(keys, ignore_deletes=True)
    try:
        async for entry in watcher:
            if entry is None:
                break
            values[entry.key] = entry.value or b""
    finally:
        await watcher.stop()
    return values


class RecordsKV:
    def __init__(self, records: KeyValue, signers: KeyValue) -> None:
        self._records = records
        self._signers = signers

    @classmethod
    async def open(cls, js: JetStreamContext) -> "RecordsKV":
        records = await open_bucket(js, subjects.REGISTRY_RECORDS_BUCKET)
        signers = await open_bucket(js, subjects.REGISTRY_SIGNERS_BUCKET)
        return cls(records, signers)

    async def load_records(self) -> list[AdapterRecord]:
        return [AdapterRecord.model_validate_json(v) for v in (await load_all(self._records)).values()]

    async def load_adapter(self, adapter_id: str) -> list[AdapterRecord]:
        """Every stored version of one adapter."""
        found = await load_all(self._records, record_key(adapter_id, 0).rsplit(".", 1)[0] + ".*")
        return [AdapterRecord.model_validate_json(v) for v in found.values()]

    async def put_record(self, record: AdapterRecord) -> int:
        """Store the record; returns the bucket revision of the write."""
        return await self._records.put(record_key(record.adapter_id, record.version), record.model_dump_json().encode())

    async def load_signers(self) -> dict[str, SignerRecord]:
        return {k: _signer(k, v) for k, v in (await load_all(self._signers)).items()}

    async def put_signer(self, record: SignerRecord) -> None:
        await self._signers.put(record.signer, record.model_dump_json().encode())


def _signer(name: str, value: bytes) -> SignerRecord:
    """A stored signer; one stored as a bare key (before tenant binding) may sign for no tenant
    until it is rotated with its tenants named."""
    text = value.decode()
    if text.startswith("{"):
        return SignerRecord.model_validate_json(text)
    return SignerRecord(signer=name, public_key=text.strip(), tenants=[])


@dataclass(frozen=True, slots=True)
class AuditedBucket:
    """A registry KV bucket as the load / put / delete / audit callables its ops take, each change's
    ``AdminAudit`` published on the AUDIT stream."""

    js: JetStreamContext
    bucket: KeyValue

    @classmethod
    async def open(cls, js: JetStreamContext, name: str) -> "AuditedBucket":
        return cls(js, await open_bucket(js, name))

    async def load(self) -> dict[str, bytes]:
        return await load_all(self.bucket)

    async def put(self, key: str, value: bytes) -> None:
        await self.bucket.put(key, value)

    async def delete(self, key: str) -> None:
        await self.bucket.delete(key)

    async def audit(self, event: AdminAudit) -> None:
        if not await publish_audit(self.js, event, f"admin.{uuid.uuid4().hex}"):
            raise ServiceUnavailable(f"{event.action} of {event.target} is stored, but its audit record is not yet")
