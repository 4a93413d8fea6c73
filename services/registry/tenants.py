"""Tenants, their quotas and their API keys: the registry ops behind ``lf.registry.tenant_*``,
``quota_set`` and ``api_key_*``.

Records live in the KV bucket ``lf_tenants`` (``tenant.<id>``, ``key.<key_id>``); every change
is written there first, so a gateway watching the bucket sees a revocation within milliseconds,
then recorded on the AUDIT stream (``AdminAudit``: who, what, the new value, never a secret).
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Literal

from shared import subjects
from shared.api_keys import new_key
from shared.catalog.access import SHARED_TENANT
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.schemas import (
    AdminAudit,
    ApiKeyCreatedReply,
    ApiKeyInfo,
    ApiKeyRecord,
    ApiKeysReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListApiKeysRequest,
    ListTenantsRequest,
    RevokeApiKeyRequest,
    SetQuotaRequest,
    TenantRecord,
    TenantsReply,
)
from shared.undecodable import skip

Put = Callable[[str, bytes], Awaitable[None]]
Audit = Callable[[AdminAudit], Awaitable[None]]
TENANT_PREFIX = "tenant."
KEY_PREFIX = "key."
AdminAction = Literal["tenant_created", "quota_set", "api_key_created", "api_key_revoked"]


def tenant_key(tenant_id: str) -> str:
    return f"{TENANT_PREFIX}{tenant_id}"


def api_key_key(key_id: str) -> str:
    return f"{KEY_PREFIX}{key_id}"


def _quota(record: TenantRecord) -> dict:
    return record.quota.model_dump(mode="json")


def info(record: ApiKeyRecord) -> ApiKeyInfo:
    return ApiKeyInfo(
        key_id=record.key_id,
        tenant_id=record.tenant_id,
        scopes=record.scopes,
        created_at=record.created_at,
        revoked=record.revoked,
    )


class Tenants:
    """In-memory view of the bucket, written through ``put`` before each change applies."""

    def __init__(self, entries: dict[str, bytes], put: Put, audit: Audit) -> None:
        self.tenants: dict[str, TenantRecord] = {}
        self.keys: dict[str, ApiKeyRecord] = {}
        for key, value in entries.items():
            try:
                self.apply(key, value, 0)
            except ValueError as e:  # a start-up is not stopped by one bad entry
                skip(subjects.REGISTRY_TENANTS_BUCKET, key, e)
        self._put = put
        self._audit = audit
        self._lock = asyncio.Lock()

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """One entry of ``lf_tenants``' watch: a change any registry replica made (ValidationError: a
        value that does not decode, which the watch skips and counts)."""
        if key.startswith(TENANT_PREFIX):
            if value is None:
                self.tenants.pop(key.removeprefix(TENANT_PREFIX), None)
            else:
                record = TenantRecord.model_validate_json(value)
                self.tenants[record.tenant_id] = record
        elif key.startswith(KEY_PREFIX):
            if value is None:
                self.keys.pop(key.removeprefix(KEY_PREFIX), None)
            else:
                api_key = ApiKeyRecord.model_validate_json(value)
                self.keys[api_key.key_id] = api_key

    async def create_tenant(self, req: CreateTenantRequest) -> TenantsReply:
        if req.tenant_id == SHARED_TENANT:
            raise InvalidRequest(f"'{SHARED_TENANT}' is reserved for adapters shared across tenants", param="tenant_id")
        async with self._lock:
            if req.tenant_id in self.tenants:
                raise Conflict(f"tenant '{req.tenant_id}' already exists")
            record = TenantRecord(tenant_id=req.tenant_id, quota=req.quota)
            await self._store_tenant(record)
            await self._record(req.actor, record.tenant_id, "tenant_created", record.tenant_id, quota=_quota(record))
        return TenantsReply(tenants=[record])

    async def list_tenants(self, req: ListTenantsRequest) -> TenantsReply:
        return TenantsReply(tenants=[t for name, t in sorted(self.tenants.items()) if req.tenant_id in (None, name)])

    async def set_quota(self, req: SetQuotaRequest) -> TenantsReply:
        async with self._lock:
            before = self._tenant(req.tenant_id)
            record = before.model_copy(update={"quota": req.quota})
            await self._store_tenant(record)
            await self._record(
                req.actor, record.tenant_id, "quota_set", record.tenant_id, before=_quota(before), quota=_quota(record)
            )
        return TenantsReply(tenants=[record])

    async def create_key(self, req: CreateApiKeyRequest) -> ApiKeyCreatedReply:
        """A new key of an existing tenant; the reply is the only place its secret appears."""
        self._tenant(req.tenant_id)
        key, record = new_key(req.tenant_id, sorted(set(req.scopes)))
        async with self._lock:
            await self._store_key(record)
            await self._record(req.actor, record.tenant_id, "api_key_created", record.key_id, scopes=record.scopes)
        return ApiKeyCreatedReply(key=key, info=info(record))

    async def revoke_key(self, req: RevokeApiKeyRequest) -> ApiKeysReply:
        async with self._lock:
            record = self.keys.get(req.key_id)
            if record is None or req.tenant_id not in (None, record.tenant_id):
                raise NotFound(f"API key '{req.key_id}' does not exist", param="key_id")
            record = record.model_copy(update={"revoked": True})
            await self._store_key(record)
            await self._record(req.actor, record.tenant_id, "api_key_revoked", record.key_id, scopes=record.scopes)
        return ApiKeysReply(keys=[info(record)])

    async def list_keys(self, req: ListApiKeysRequest) -> ApiKeysReply:
        records = sorted(self.keys.values(), key=lambda r: (r.tenant_id, r.created_at))
        return ApiKeysReply(keys=[info(r) for r in records if req.tenant_id in (None, r.tenant_id)])

    def slot_quota(self, tenant_id: str, default: int) -> int | None:
        """The tenant's GPU slot quota per rank class: its own, else the platform's ``default``, as the
        scheduler applies them; None for no limit (0)."""
        record = self.tenants.get(tenant_id)
        own = record.quota.max_gpu_adapter_slots if record else None
        return (own if own is not None else default) or None

    def _tenant(self, tenant_id: str) -> TenantRecord:
        record = self.tenants.get(tenant_id)
        if record is None:
            raise NotFound(f"tenant '{tenant_id}' does not exist", param="tenant_id")
        return record

    async def _record(self, actor: str, tenant_id: str, action: AdminAction, target: str, **detail: object) -> None:
        await self._audit(AdminAudit(actor=actor, tenant_id=tenant_id, action=action, target=target, detail=detail))

    async def _store_tenant(self, record: TenantRecord) -> None:
        await self._put(tenant_key(record.tenant_id), record.model_dump_json().encode())
        self.tenants[record.tenant_id] = record

    async def _store_key(self, record: ApiKeyRecord) -> None:
        await self._put(api_key_key(record.key_id), record.model_dump_json().encode())
        self.keys[record.key_id] = record
