"""The registry's answers every other service reads: one version's record, the trusted signers."""

from nats.aio.client import Client as NATS

from shared import subjects
from shared.bus import request
from shared.errors import ModelNotFound
from shared.schemas import AdapterRecord, AdapterRecordsReply, GetAdapterRequest, ListKeysRequest, TrustedKeysReply


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
