"""Every change to tenants, API keys, quotas and signer trust leaves an audit record on the AUDIT
stream (a real registry on a real nats-server), and a push signed by a signer bound to another
tenant is refused with a typed error and audited."""

import uuid
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js.api import DeliverPolicy

from lorafleet.cli.adapter_cmd import push_adapter
from services.registry.push_admission import BaseModelIdentity
from shared import signing, subjects
from shared.api_keys import parse_key
from shared.bus import decode, request
from shared.errors import Conflict, SignerNotAuthorized
from shared.schemas import (
    ApiKeyCreatedReply,
    ApiKeysReply,
    AuditEnvelope,
    CreateApiKeyRequest,
    CreateTenantRequest,
    RevokeApiKeyRequest,
    SetQuotaRequest,
    TenantQuota,
    TenantsReply,
    TrustedKeysReply,
    TrustKeyRequest,
    UntrustKeyRequest,
)


async def audited(nc: NATS, kind: str, tenant: str, count: int) -> list[dict]:
    """The first ``count`` records of ``kind`` for ``tenant`` on the AUDIT stream, as the auditor stores them."""
    js = nc.jetstream()
    sub = await js.subscribe(
        subjects.audit(kind, tenant),
        stream=subjects.AUDIT_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    try:
        return [
            decode(AuditEnvelope, (await sub.next_msg(timeout=5)).data).body.model_dump(mode="json")
            for _ in range(count)
        ]
    finally:
        await sub.unsubscribe()


async def test_tenant_key_and_quota_changes_are_audited(registry: NATS) -> None:
    tenant = f"t{uuid.uuid4().hex[:8]}"
    await request(
        registry,
        subjects.registry("tenant_create"),
        CreateTenantRequest(tenant_id=tenant, actor="ops:ann"),
        TenantsReply,
        5,
    )
    created = await request(
        registry,
        subjects.registry("api_key_create"),
        CreateApiKeyRequest(tenant_id=tenant, scopes=["platform_admin"], actor="ops:ann"),
        ApiKeyCreatedReply,
        5,
    )
    quota = SetQuotaRequest(tenant_id=tenant, quota=TenantQuota(max_concurrent=3), actor="ops:bob")
    await request(registry, subjects.registry("quota_set"), quota, TenantsReply, 5)
    revoke = RevokeApiKeyRequest(key_id=created.info.key_id, actor="ops:bob")
    await request(registry, subjects.registry("api_key_revoke"), revoke, ApiKeysReply, 5)

    records = await audited(registry, "admin", tenant, 4)
    summary = [(r["action"], r["actor"], r["target"]) for r in records]
    assert summary == [
        ("tenant_created", "ops:ann", tenant),
        ("api_key_created", "ops:ann", created.info.key_id),
        ("quota_set", "ops:bob", tenant),
        ("api_key_revoked", "ops:bob", created.info.key_id),
    ]
    assert records[1]["detail"] == {"scopes": ["platform_admin"]}
    assert (
        records[2]["detail"]["quota"]["max_concurrent"] == 3
        and records[2]["detail"]["before"]["max_concurrent"] is None
    )
    parsed = parse_key(created.key)
    assert parsed is not None
    secret = parsed[1]
    assert all(secret not in str(r) for r in records)  # a key's secret is never recorded


async def test_signer_trust_is_audited_bound_and_never_silently_replaced(
    registry: NATS, peft_adapter_dir: Path, base: BaseModelIdentity, tmp_path: Path
) -> None:
    tenant, other = f"t{uuid.uuid4().hex[:8]}", f"o{uuid.uuid4().hex[:8]}"
    signer = f"s{uuid.uuid4().hex[:8]}"
    first, second = signing.generate_keypair(), signing.generate_keypair()

    async def trust(keys: signing.KeyPair, rotate: bool = False) -> TrustedKeysReply:
        message = TrustKeyRequest(
            signer=signer, public_key=keys.public_b64, tenants=[tenant], rotate=rotate, actor="ops"
        )
        return await request(registry, subjects.registry("trust_key"), message, TrustedKeysReply, 5)

    await trust(first)
    with pytest.raises(Conflict, match="needs rotate"):
        await trust(second)
    assert (await trust(first)).keys[signer] == first.public_b64  # the same again changes nothing
    reply = await trust(second, rotate=True)
    (record,) = [s for s in reply.signers if s.signer == signer]
    assert (record.public_key, record.retired_keys, record.tenants) == (second.public_b64, [first.public_b64], [tenant])
    untrust = UntrustKeyRequest(signer=signer, actor="ops")
    reply = await request(registry, subjects.registry("untrust_key"), untrust, TrustedKeysReply, 5)
    assert signer not in reply.keys and [s.trusted for s in reply.signers if s.signer == signer] == [False]

    records = await audited(registry, "admin", tenant, 3)
    assert [(r["action"], r["target"]) for r in records] == [
        ("signer_trusted", signer),
        ("signer_rotated", signer),
        ("signer_untrusted", signer),
    ]
    assert records[1]["detail"]["key_changed"] is True and records[1]["detail"]["public_key"] == second.public_b64

    await trust(second, rotate=True)  # trusted again, still for ``tenant`` only
    key_file = tmp_path / f"{signer}.key"
    key_file.write_bytes(second.private_pem)
    await request(
        registry, subjects.registry("tenant_create"), CreateTenantRequest(tenant_id=other, actor="ops"), TenantsReply, 5
    )
    with pytest.raises(SignerNotAuthorized, match=f"may not sign adapters of tenant {other}"):
        await push_adapter(
            registry,
            peft_adapter_dir,
            adapter_id=f"{other}-sum",
            tenant_id=other,
            task_type="t",
            base_fingerprint=base.fingerprint,
            sign_key=key_file,
        )
    (refusal,) = await audited(registry, "rejection", other, 1)
    assert (refusal["code"], refusal["request_id"]) == ("signer_not_authorized", f"register.{other}-sum")
