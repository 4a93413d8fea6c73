"""Tenants, quotas and API keys as registry ops: stored hashed, listed without secrets, revocable."""

import asyncio
import hashlib
import sys

import pytest

from services.registry.tenants import Tenants
from shared import subjects
from shared.api_keys import matches, parse_key
from shared.bus import request
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.schemas import (
    AdminAudit,
    ApiKeyCreatedReply,
    ApiKeyRecord,
    ApiKeysReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListApiKeysRequest,
    ListTenantsRequest,
    RevokeApiKeyRequest,
    SetQuotaRequest,
    TenantQuota,
    TenantsReply,
)


async def call(nc, op, message, reply):
    return await request(nc, subjects.registry(op), message, reply, 5)


def book() -> tuple[Tenants, dict[str, bytes]]:
    stored: dict[str, bytes] = {}

    async def put(key: str, value: bytes) -> None:
        stored[key] = value

    async def audit(event: AdminAudit) -> None:
        pass

    return Tenants({}, put, audit), stored


async def test_key_is_stored_as_salted_hash_only():
    tenants, stored = book()
    await tenants.create_tenant(CreateTenantRequest(tenant_id="acme", actor="t"))
    created = await tenants.create_key(CreateApiKeyRequest(tenant_id="acme", scopes=["inference", "admin"], actor="t"))
    key_id, secret = parse_key(created.key)
    raw = stored[f"key.{key_id}"]
    assert secret.encode() not in raw
    record = ApiKeyRecord.model_validate_json(raw)
    assert record.secret_sha256 != hashlib.sha256(secret.encode()).hexdigest()  # salted
    assert matches(record, secret) and not matches(record, secret[:-1] + "x")
    assert record.scopes == ["admin", "inference"]


async def test_same_secret_different_salts_give_different_hashes():
    tenants, _ = book()
    await tenants.create_tenant(CreateTenantRequest(tenant_id="acme", actor="t"))
    a = await tenants.create_key(CreateApiKeyRequest(tenant_id="acme", actor="t"))
    b = await tenants.create_key(CreateApiKeyRequest(tenant_id="acme", actor="t"))
    assert tenants.keys[a.info.key_id].salt != tenants.keys[b.info.key_id].salt


async def test_refusals():
    tenants, _ = book()
    await tenants.create_tenant(CreateTenantRequest(tenant_id="acme", actor="t"))
    with pytest.raises(Conflict):
        await tenants.create_tenant(CreateTenantRequest(tenant_id="acme", actor="t"))
    with pytest.raises(InvalidRequest):
        await tenants.create_tenant(CreateTenantRequest(tenant_id="shared", actor="t"))
    with pytest.raises(NotFound):
        await tenants.create_key(CreateApiKeyRequest(tenant_id="ghost", actor="t"))
    with pytest.raises(NotFound):
        await tenants.set_quota(SetQuotaRequest(tenant_id="ghost", quota=TenantQuota(), actor="t"))


async def test_revoke_is_tenant_scoped():
    tenants, _ = book()
    for name in ("acme", "globex"):
        await tenants.create_tenant(CreateTenantRequest(tenant_id=name, actor="t"))
    key = await tenants.create_key(CreateApiKeyRequest(tenant_id="acme", actor="t"))
    with pytest.raises(NotFound):
        await tenants.revoke_key(RevokeApiKeyRequest(key_id=key.info.key_id, tenant_id="globex", actor="t"))
    reply = await tenants.revoke_key(RevokeApiKeyRequest(key_id=key.info.key_id, tenant_id="acme", actor="t"))
    assert reply.keys[0].revoked


async def test_ops_over_nats_persist_in_kv(registry):
    await call(registry, "tenant_create", CreateTenantRequest(tenant_id="initech", actor="t"), TenantsReply)
    quota = TenantQuota(requests_per_min=60, tokens_per_min=10_000, max_concurrent=4, max_gpu_adapter_slots=2)
    await call(registry, "quota_set", SetQuotaRequest(tenant_id="initech", quota=quota, actor="t"), TenantsReply)
    created = await call(
        registry,
        "api_key_create",
        CreateApiKeyRequest(tenant_id="initech", scopes=["admin"], actor="t"),
        ApiKeyCreatedReply,
    )
    await call(registry, "api_key_revoke", RevokeApiKeyRequest(key_id=created.info.key_id, actor="t"), ApiKeysReply)
    tenants = await call(registry, "tenants", ListTenantsRequest(tenant_id="initech"), TenantsReply)
    assert tenants.tenants[0].quota == quota
    keys = await call(registry, "api_keys", ListApiKeysRequest(tenant_id="initech"), ApiKeysReply)
    assert [(k.key_id, k.revoked) for k in keys.keys] == [(created.info.key_id, True)]
    bucket = await registry.jetstream().key_value(subjects.REGISTRY_TENANTS_BUCKET)
    stored = ApiKeyRecord.model_validate_json((await bucket.get(f"key.{created.info.key_id}")).value)
    assert stored.revoked and created.key.split("-", 2)[2] not in stored.model_dump_json()


async def _cli(nats_url: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lorafleet.cli",
        *args,
        "--nats-url",
        nats_url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def test_cli_manages_tenants_keys_and_quotas(registry, nats_url):
    await _cli(nats_url, "tenant", "create", "umbrella")
    created = await _cli(nats_url, "key", "create", "--tenant", "umbrella", "--scope", "admin")
    key = next(line for line in created.splitlines() if line.startswith("lf-"))
    key_id, secret = parse_key(key)
    assert "admin,inference" in created
    await _cli(
        nats_url, "quota", "set", "umbrella", "--rpm", "30", "--gpu-slots", "2", "--enforce", "hard", "--tier", "batch"
    )
    listed = (await _cli(nats_url, "tenant", "list")).replace(" ", "")
    assert '"requests_per_min":30' in listed and '"enforce":"hard"' in listed and '"slo_tier":"batch"' in listed
    await _cli(nats_url, "key", "revoke", key_id)
    listed = await _cli(nats_url, "key", "list", "--tenant", "umbrella")
    # the secret (URL-safe base64) may hold "-": taken from parse_key, never from splitting the key
    assert key_id in listed and "revoked" in listed and secret not in listed


async def test_up_reuses_the_demo_key_until_it_is_revoked(registry, nats_url, tmp_path):
    from lorafleet.cli.demo_tenant import ensure_demo_key

    first = await ensure_demo_key(nats_url, tmp_path)
    assert await ensure_demo_key(nats_url, tmp_path) == first
    assert (tmp_path / "demo-api-key").stat().st_mode & 0o777 == 0o600
    await call(registry, "api_key_revoke", RevokeApiKeyRequest(key_id=parse_key(first)[0], actor="t"), ApiKeysReply)
    second = await ensure_demo_key(nats_url, tmp_path)
    assert second != first and parse_key(second) is not None
