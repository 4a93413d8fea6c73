"""The registry's answers every other service reads: one version's record, the trusted signers."""

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from shared import subjects
from shared.bus import request
from shared.catalog import record_key
from shared.errors import ModelNotFound
from shared.kv_read import read_latest
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    GetAdapterRequest,
    ListKeysRequest,
    SignerRecord,
    TrustedKeysReply,
)


async def fetch_record(nc: NATS, adapter_id: str, version: int | None, timeout_s: float) -> AdapterRecord:
    """The registry's record of one version (what a ResolvedAdapter names), via ``lf.registry.get``;
    a version of None asks for every version and answers the first."""
    message = GetAdapterRequest(adapter_id=adapter_id, version=version)
    records = (await request(nc, subjects.registry("get"), message, AdapterRecordsReply, timeout_s)).records
    if not records:
        raise ModelNotFound(f"the registry has no {adapter_id} v{version}")
    return records[0]


async def fetch_trusted_keys(nc: NATS, timeout_s: float) -> dict[str, list[str]]:
    """Each signer's keys whose signatures still verify (signer -> base64 Ed25519 public keys), via
    ``lf.registry.keys``: an untrusted signer's versions stay servable until they are revoked, and a
    rotated signer's earlier keys still verify the versions they signed."""
    reply = await request(nc, subjects.registry("keys"), ListKeysRequest(), TrustedKeysReply, timeout_s)
    return {s.signer: s.verify_keys() for s in reply.signers}


def parse_signer(name: str, value: bytes) -> SignerRecord:
    """A signer as the registry stores it in ``lf_signers``; one stored as a bare key (before tenant
    binding) may sign for no tenant until it is rotated with its tenants named."""
    text = value.decode()
    if text.startswith("{"):
        return SignerRecord.model_validate_json(text)
    return SignerRecord(signer=name, public_key=text.strip(), tenants=[])


async def read_record(js: JetStreamContext, adapter_id: str, version: int) -> AdapterRecord:
    """One version's record straight from the registry's records bucket: what a worker's cold load
    reads, so that no registry replica (dead, or stalled) sits on its path."""
    bucket = await js.key_value(subjects.REGISTRY_RECORDS_BUCKET)
    try:
        entry = await bucket.get(record_key(adapter_id, version))
    except KeyNotFoundError:
        raise ModelNotFound(f"the registry has no {adapter_id} v{version}") from None
    return AdapterRecord.model_validate_json(entry.value or b"")


async def read_trusted_keys(js: JetStreamContext) -> dict[str, list[str]]:
    """``fetch_trusted_keys``'s answer read from the signers bucket itself (no registry round trip)."""
    bucket = await js.key_value(subjects.REGISTRY_SIGNERS_BUCKET)
    keys: dict[str, list[str]] = {}
    for entry in await read_latest(bucket):
        signer = parse_signer(entry.key, entry.value)
        keys[signer.signer] = signer.verify_keys()
    return keys
