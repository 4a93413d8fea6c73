"""Registry data in JetStream KV: adapter records and trusted signer keys.

Any number of registry replicas share these buckets; none holds state the others lack. Every
write is a compare-and-set against the revision the writer planned from: one change of several
records is one atomic batch (JetStream atomic batch publish, each message with its key's expected
last revision, 0 for a new key), so two replicas changing one adapter at once never interleave:
one commits whole, the other is refused whole (``StaleRecords``), reloads and plans again.
"""

import dataclasses
import json
import uuid
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import ensure_replicas, settling
from shared.catalog.records import record_key
from shared.catalog.signers import parse_signer
from shared.errors import Conflict, ServiceUnavailable
from shared.kv_read import read_latest
from shared.schemas import AdapterRecord, AdminAudit, AuditEvent, SignerRecord
from shared.undecodable import decoded, skip


async def publish_registry_audit(js: JetStreamContext, event: AuditEvent) -> None:
    """Store one of the registry's audit records (retried under one message id, as every service's are);
    ServiceUnavailable when it could not be stored."""
    if not await publish_audit(js, event, f"{event.kind}.registry.{uuid.uuid4().hex}"):
        raise ServiceUnavailable(f"the registry's {event.kind} audit record could not be stored")


@settling
async def open_bucket(js: JetStreamContext, name: str, replicas: int | None = None) -> KeyValue:
    """A registry KV bucket (file storage, 5 revisions, ``LF_JETSTREAM_REPLICAS`` copies), created when
    missing; one made with another replica count is brought to this one."""
    wanted = await ensure_replicas(js, f"KV_{name}", replicas)
    config = KeyValueConfig(bucket=name, history=5, storage=StorageType.FILE, replicas=wanted)
    try:
        kv = await js.key_value(name)  # made before (its stream may have settings nats-py's KV config lacks)
    except BucketNotFoundError:
        try:
            kv = await js.create_key_value(config=config)
        except BadRequestError:  # another replica made it first
            kv = await js.key_value(name)
    await ensure_replicas(js, f"KV_{name}", wanted, check=True)
    return kv


async def load_all(kv: KeyValue, keys: str = ">") -> dict[str, bytes]:
    """Every live key's value (of those ``keys`` matches), streamed by one watcher (one round trip,
    not one per key)."""
    return {v.key: v.value for v in await read_latest(kv, keys)}


RECORDS = subjects.REGISTRY_RECORDS_BUCKET
COMMIT_ATTEMPTS = 5  # plans of one change against records another replica keeps changing


def contended(what: str) -> Conflict:
    """The answer when ``COMMIT_ATTEMPTS`` plans of one change all lost to other replicas' writes."""
    return Conflict(
        f"{what} was changed by other registry replicas {COMMIT_ATTEMPTS} times while this change was planned; retry"
    )


class StaleRecords(Exception):
    """A compare-and-set write found a key at another revision than planned from: another replica
    changed it first. Nothing of the batch was written."""


WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code for a failed expected-last-subject-sequence check


@settling
async def allow_atomic(js: JetStreamContext, bucket: str) -> None:
    """Let the bucket's stream take atomic batches (nats-server 2.12+); nats-py's KV config has no
    such field, so the stream is updated after creation."""
    info = await js.stream_info(f"KV_{bucket}")
    if not info.config.allow_atomic:
        await js.update_stream(dataclasses.replace(info.config, allow_atomic=True))


class RecordsKV:
    def __init__(self, records: KeyValue, signers: KeyValue, js: JetStreamContext | None = None) -> None:
        self._records = records
        self._signers = signers
        self._js = js

    @classmethod
    async def open(cls, js: JetStreamContext) -> "RecordsKV":
        records = await open_bucket(js, subjects.REGISTRY_RECORDS_BUCKET)
        await allow_atomic(js, subjects.REGISTRY_RECORDS_BUCKET)
        signers = await open_bucket(js, subjects.REGISTRY_SIGNERS_BUCKET)
        return cls(records, signers, js)

    async def load_records(self) -> list[AdapterRecord]:
        """Every stored record; one that does not decode is skipped and counted."""
        entries = (await load_all(self._records)).items()
        return [record for _, record in decoded(entries, AdapterRecord.model_validate_json, RECORDS)]

    async def load_adapter(self, adapter_id: str) -> list[tuple[AdapterRecord, int]]:
        """Every stored version of one adapter, each with its bucket revision (undecodable ones skipped)."""
        versions = record_key(adapter_id, 0).rsplit(".", 1)[0] + ".*"
        entries = [(v.revision, v.value) for v in await read_latest(self._records, versions)]
        return [(record, revision) for revision, record in decoded(entries, AdapterRecord.model_validate_json, RECORDS)]

    async def commit(self, writes: list[tuple[AdapterRecord, int]]) -> list[int]:
        """Write every record at once if each key is still at its given revision (0: absent), or none
        (``StaleRecords``). Returns each write's bucket revision (a batch is stored as consecutive
        messages ending at the acknowledged sequence)."""
        assert writes, "a commit writes at least one record"
        assert self._js is not None, "opened with RecordsKV.open"
        nc = self._js._nc  # nats-py's JetStream context has no batch publish: its connection sends it
        batch = uuid.uuid4().hex
        bucket = subjects.REGISTRY_RECORDS_BUCKET
        for i, (record, revision) in enumerate(writes, start=1):
            subject = f"$KV.{bucket}.{record_key(record.adapter_id, record.version)}"
            headers = {
                "Nats-Batch-Id": batch,
                "Nats-Batch-Sequence": str(i),
                "Nats-Expected-Last-Subject-Sequence": str(revision),
            }
            data = record.model_dump_json().encode()
            if i < len(writes):
                await nc.publish(subject, data, headers=headers)
                continue
            headers["Nats-Batch-Commit"] = "1"
            reply = json.loads((await nc.request(subject, data, headers=headers, timeout=5.0)).data)
            error = reply.get("error")
            if error is None:
                last, count = int(reply["seq"]), int(reply.get("count", 1))
                assert count == len(writes), f"batch of {len(writes)} acknowledged as {count}"
                return list(range(last - count + 1, last + 1))
            if error.get("err_code") == WRONG_LAST_SEQUENCE:
                raise StaleRecords(f"{record.adapter_id}: {error.get('description')}")
            raise ServiceUnavailable(f"records of {record.adapter_id} not stored: {error.get('description')}")
        raise AssertionError("unreachable")

    async def put_record(self, record: AdapterRecord) -> int:
        """Store the record unconditionally (migrations, tests); returns the bucket revision of the write."""
        return await self._records.put(record_key(record.adapter_id, record.version), record.model_dump_json().encode())

    async def load_signers(self) -> dict[str, SignerRecord]:
        """Every trusted signer; one that does not decode is skipped and counted (it trusts nobody)."""
        signers = {}
        for name, value in (await load_all(self._signers)).items():
            try:
                signers[name] = parse_signer(name, value)
            except ValueError as e:
                skip(subjects.REGISTRY_SIGNERS_BUCKET, name, e)
        return signers

    async def load_signer(self, name: str) -> tuple[SignerRecord | None, int]:
        """One signer as stored now, with its revision (0: none)."""
        try:
            entry = await self._signers.get(name)
        except KeyNotFoundError:
            return None, 0
        if entry.value is None:
            return None, entry.revision or 0
        return parse_signer(name, entry.value), entry.revision or 0

    async def put_signer(self, record: SignerRecord, revision: int | None = None) -> None:
        """Store the signer; with ``revision`` only if it is still at it (0: absent), else ``StaleRecords``."""
        value = record.model_dump_json().encode()
        if revision is None:
            await self._signers.put(record.signer, value)
            return
        try:
            if revision == 0:
                await self._signers.create(record.signer, value)
            else:
                await self._signers.update(record.signer, value, last=revision)
        except KeyWrongLastSequenceError as e:
            raise StaleRecords(f"signer {record.signer}: {e}") from None


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
