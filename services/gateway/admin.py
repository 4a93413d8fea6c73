"""Admin API for tenants, API keys and quotas: each route is one registry op.

Who may do what (keys carry scopes, see auth.py): an ``admin`` key manages its own tenant
only (its keys, reading its tenant record and quota); a ``platform_admin`` key manages every
tenant, creates tenants, sets quotas and grants ``platform_admin``. Another tenant's objects
answer the same 404 as missing ones.
"""

from typing import TypeVar

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.auth import Principal, admin_caller
from services.gateway.openai_responses import error_responses
from shared import subjects
from shared.bus import request as bus_request
from shared.errors import Forbidden, NotFound
from shared.schemas import (
    ApiKeyCreatedReply,
    ApiKeysReply,
    ApiScope,
    CreateApiKeyRequest,
    CreateTenantRequest,
    Identifier,
    ListApiKeysRequest,
    ListTenantsRequest,
    RevokeApiKeyRequest,
    SetQuotaRequest,
    TenantQuota,
    TenantsReply,
    default_key_scopes,
)

M = TypeVar("M", bound=BaseModel)
router = APIRouter(prefix="/admin", tags=["admin"])
ERROR_STATUSES = (400, 401, 403, 404, 413, 503, 504)
ERRORS = error_responses(*ERROR_STATUSES)


class NewTenant(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier
    quota: TenantQuota = Field(default_factory=TenantQuota)


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier | None = Field(default=None, description="default: the caller's tenant")
    scopes: list[ApiScope] = Field(default_factory=default_key_scopes, min_length=1, max_length=3)


def actor(caller: Principal) -> str:
    """Who the audit trail names for a change made through the gateway."""
    return f"apikey:{caller.key_id or 'config'}"


async def registry_call(request: Request, op: str, message: BaseModel, reply: type[M]) -> M:
    ctx = request.app.state.ctx
    return await bus_request(ctx.nc, subjects.registry(op), message, reply, ctx.settings.registry_timeout_s)


def scoped_tenant(caller: Principal, tenant_id: str | None) -> str | None:
    """The tenant a call acts on: any (None = all) for a platform admin, else only the caller's own."""
    if caller.platform_admin:
        return tenant_id
    if tenant_id not in (None, caller.tenant_id):
        raise NotFound(f"tenant '{tenant_id}' does not exist", param="tenant_id")
    return caller.tenant_id


def require_platform(caller: Principal) -> None:
    if not caller.platform_admin:
        raise Forbidden("this needs a platform_admin key")


@router.get("/tenants", response_model=TenantsReply, responses=ERRORS)
async def list_tenants(
    request: Request, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> TenantsReply:
    """Tenants and their quotas: all of them for a platform admin, else the caller's own."""
    return await registry_call(
        request, "tenants", ListTenantsRequest(tenant_id=scoped_tenant(caller, tenant)), TenantsReply
    )


@router.post("/tenants", response_model=TenantsReply, status_code=201, responses=error_responses(409, *ERROR_STATUSES))
async def create_tenant(body: NewTenant, request: Request, caller: Principal = Depends(admin_caller)) -> TenantsReply:
    require_platform(caller)
    message = CreateTenantRequest(tenant_id=body.tenant_id, quota=body.quota, actor=actor(caller))
    return await registry_call(request, "tenant_create", message, TenantsReply)


@router.put("/tenants/{tenant_id}/quota", response_model=TenantsReply, responses=ERRORS)
async def set_quota(
    tenant_id: Identifier, quota: TenantQuota, request: Request, caller: Principal = Depends(admin_caller)
) -> TenantsReply:
    """Replace the tenant's limits (None = unlimited); the scheduler enforces them."""
    require_platform(caller)
    message = SetQuotaRequest(tenant_id=tenant_id, quota=quota, actor=actor(caller))
    return await registry_call(request, "quota_set", message, TenantsReply)


@router.get("/keys", response_model=ApiKeysReply, responses=ERRORS)
async def list_keys(
    request: Request, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> ApiKeysReply:
    """API keys without their secrets."""
    return await registry_call(
        request, "api_keys", ListApiKeysRequest(tenant_id=scoped_tenant(caller, tenant)), ApiKeysReply
    )


@router.post("/keys", response_model=ApiKeyCreatedReply, status_code=201, responses=ERRORS)
async def create_key(body: NewKey, request: Request, caller: Principal = Depends(admin_caller)) -> ApiKeyCreatedReply:
    """A new key; its secret is in this reply only."""
    if "platform_admin" in body.scopes:
        require_platform(caller)
    tenant_id = scoped_tenant(caller, body.tenant_id) or caller.tenant_id
    message = CreateApiKeyRequest(tenant_id=tenant_id, scopes=body.scopes, actor=actor(caller))
    return await registry_call(request, "api_key_create", message, ApiKeyCreatedReply)


@router.delete("/keys/{key_id}", response_model=ApiKeysReply, responses=ERRORS)
async def revoke_key(
    request: Request, key_id: str = Path(pattern=r"^[0-9a-f]{16}$"), caller: Principal = Depends(admin_caller)
) -> ApiKeysReply:
    """Revoke at once: the gateways' key mirrors drop it within milliseconds."""
    message = RevokeApiKeyRequest(key_id=key_id, tenant_id=scoped_tenant(caller, None), actor=actor(caller))
    return await registry_call(request, "api_key_revoke", message, ApiKeysReply)
