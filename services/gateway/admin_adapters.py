"""Admin API for adapters: push (multipart upload), list, lifecycle steps; one registry op each.

An ``admin`` key acts on its own tenant's adapters; a ``platform_admin`` key on any, including
``shared`` ones. Another tenant's adapter answers exactly like a missing one (404).
"""

import secrets

from fastapi import APIRouter, Depends, File, Form, Path, Request, UploadFile
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.admin import ERROR_STATUSES, ERRORS, actor, registry_call, scoped_tenant
from services.gateway.auth import Principal, admin_caller
from services.gateway.openai_responses import ErrorResponse, error_responses
from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import request as bus_request
from shared.errors import Forbidden, InvalidRequest, NotFound, PayloadTooLarge
from shared.eval_set import EVAL_SET_FILE, MAX_EVAL_SET_BYTES
from shared.schemas import (
    AdapterRecordsReply,
    AttachEvalSetRequest,
    GetAdapterRequest,
    Identifier,
    ListAdaptersRequest,
    ListPinsRequest,
    PinRequest,
    PinsReply,
    PromoteRequest,
    RegisterRequest,
    RetireRequest,
    RevokeRequest,
    RollbackRequest,
    RolloutRequest,
    TrafficPercent,
)

router = APIRouter(prefix="/admin/adapters", tags=["admin"])
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # Identifier's pattern: FastAPI drops an Annotated pattern under a Form() default
AdapterId = Path(pattern=ID_PATTERN)
CHANGE_ERRORS = error_responses(409, *ERROR_STATUSES)
PUSH_ERRORS = {
    **CHANGE_ERRORS,
    502: {"model": ErrorResponse, "description": "the remote source failed, or its TLS certificate did not verify"},
    **error_responses(429),  # the tenant's remote fetches in flight are at their bound: see Retry-After
    507: {
        "model": ErrorResponse,
        "description": "the fetches in flight hold the registry's spool quota; see Retry-After",
    },
}
REMOTE_SCHEMES = ("s3://", "https://")  # a tenant admin never names a file:// path on the registry's host


class Promote(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)
    traffic_percent: TrafficPercent = 1.0
    skip_eval: bool = Field(
        default=False,
        description="pass the version without its platform-run eval: a platform_admin key only, with a reason (audited)",
    )
    reason: str | None = Field(default=None, max_length=500, description="why, for the audit trail")


class AttachEvalSet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)
    eval_set: str = Field(
        min_length=1, max_length=MAX_EVAL_SET_BYTES, description="the eval set's JSONL text (see docs/api.md)"
    )


class Rollout(BaseModel):
    model_config = ConfigDict(extra="forbid")
    traffic_percent: TrafficPercent


class Retire(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1)


class Revoke(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int | None = Field(default=None, ge=1, description="None = every version")


class Pin(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int | None = Field(default=None, ge=1, description="None = whatever version is served")
    worker: Identifier | None = Field(default=None, description="None = every worker")


def not_found(adapter_id: str) -> NotFound:
    return NotFound(f"adapter '{adapter_id}' does not exist or you do not have access to it", param="adapter_id")


async def owned(request: Request, caller: Principal, adapter_id: str) -> AdapterRecordsReply:
    """The adapter's versions if the caller may manage it; 404 (same as missing) otherwise."""
    reply = await registry_call(request, "get", GetAdapterRequest(adapter_id=adapter_id), AdapterRecordsReply)
    if not reply.records or not (caller.platform_admin or reply.records[-1].tenant_id == caller.tenant_id):
        raise not_found(adapter_id)
    return reply


@router.get("", response_model=AdapterRecordsReply, responses=ERRORS)
async def list_adapters(
    request: Request, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    """Every version of the tenant's adapters (every tenant's, for a platform admin without ?tenant)."""
    message = ListAdaptersRequest(tenant_id=scoped_tenant(caller, tenant))
    return await registry_call(request, "adapters", message, AdapterRecordsReply)


@router.get("/{adapter_id}", response_model=AdapterRecordsReply, responses=ERRORS)
async def get_adapter(
    request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    return await owned(request, caller, adapter_id)


async def _read(upload: UploadFile, limit: int) -> bytes:
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"{upload.filename or 'file'} exceeds {limit} bytes")
    return data


@router.post("", response_model=AdapterRecordsReply, status_code=201, responses=PUSH_ERRORS)
async def push_adapter(
    request: Request,
    adapter_id: str = Form(pattern=ID_PATTERN),
    task_type: str = Form(min_length=1, max_length=64),
    adapter_config: UploadFile | None = File(default=None, description=CONFIG_FILE),
    adapter_model: UploadFile | None = File(default=None, description=WEIGHTS_FILE),
    eval_set: UploadFile | None = File(
        default=None, description=f"{EVAL_SET_FILE}: the version's own eval set, covered by its signature"
    ),
    source_uri: str | None = Form(
        default=None,
        max_length=2048,
        description="instead of the two files: an allow-listed s3:// or https:// prefix the registry fetches them from",
    ),
    tenant_id: Identifier | None = Form(
        default=None, description="default: the caller's tenant; 'shared' needs platform_admin"
    ),
    version: int | None = Form(default=None, ge=1, description="the version a signature was made for"),
    signature: str | None = Form(default=None, max_length=200),
    signer: Identifier | None = Form(default=None),
    aliases: list[Identifier] = Form(default=[]),
    allowed_scopes: list[str] = Form(default=[]),
    caller: Principal = Depends(admin_caller),
) -> AdapterRecordsReply:
    """Upload a PEFT adapter (with its eval set, optional), or name the remote source the registry fetches
    it from (status staging); the registry validates, verifies and stores it either way."""
    tenant = scoped_tenant(caller, tenant_id) or caller.tenant_id
    uploaded = (adapter_config, adapter_model)
    if source_uri is not None:
        if any(uploaded):
            raise InvalidRequest("push: give either the two files or source_uri, not both", param="source_uri")
        if not source_uri.startswith(REMOTE_SCHEMES):
            raise InvalidRequest("push: source_uri must be an s3:// or https:// source", param="source_uri")
    elif adapter_config is None or adapter_model is None:
        raise InvalidRequest(f"push: both {CONFIG_FILE} and {WEIGHTS_FILE} are needed, or a source_uri")
    existing = await registry_call(request, "get", GetAdapterRequest(adapter_id=adapter_id), AdapterRecordsReply)
    if existing.records and not caller.platform_admin and existing.records[-1].tenant_id != caller.tenant_id:
        raise not_found(adapter_id)
    ctx = request.app.state.ctx
    upload_id = None if source_uri is not None else secrets.token_hex(12)
    # the registry fetches, then admits, before it answers: it cancels a fetch still running when this stops waiting
    wait_s = ctx.settings.remote_push_timeout_s if source_uri is not None else None
    try:
        message = RegisterRequest(
            adapter_id=adapter_id,
            tenant_id=tenant,
            task_type=task_type,
            version=version,
            upload_id=upload_id,
            source_uri=source_uri,
            signature=signature,
            signer=signer,
            aliases=aliases,
            allowed_scopes=allowed_scopes,
            wait_s=wait_s,
            actor=actor(caller),
        )
    except ValidationError as e:
        raise InvalidRequest(f"push: {e.errors()[0]['msg']}") from None
    if adapter_config is not None and adapter_model is not None:
        limit = ctx.settings.max_body_bytes
        files = {CONFIG_FILE: await _read(adapter_config, limit), WEIGHTS_FILE: await _read(adapter_model, limit)}
        if eval_set is not None:
            files[EVAL_SET_FILE] = await _read(eval_set, MAX_EVAL_SET_BYTES)
        store = await ctx.js.object_store(subjects.ADAPTER_UPLOADS_BUCKET)
        for name, data in files.items():
            await store.put(f"{upload_id}/{name}", data)
        return await registry_call(request, "register", message, AdapterRecordsReply)
    timeout_s = ctx.settings.remote_push_timeout_s
    return await bus_request(ctx.nc, subjects.registry("register"), message, AdapterRecordsReply, timeout_s)


@router.post("/{adapter_id}/promote", response_model=AdapterRecordsReply, responses=CHANGE_ERRORS)
async def promote(
    body: Promote, request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    """staging -> canary at traffic_percent (100 = production), through the release gate: the registry
    runs the version's own eval set on a worker and compares it with production's score on the same set.
    ``skip_eval`` (platform_admin only, with a reason) passes an unevaluated version, audited."""
    await owned(request, caller, adapter_id)
    if body.skip_eval and not caller.platform_admin:
        raise Forbidden("skip_eval needs a platform_admin key: a tenant's version passes the eval gate or waits")
    if body.skip_eval and not body.reason:
        raise InvalidRequest("skip_eval needs a reason (it is audited)", param="reason")
    message = PromoteRequest(
        adapter_id=adapter_id,
        version=body.version,
        traffic_percent=body.traffic_percent,
        skip_eval=body.skip_eval,
        reason=body.reason,
        actor=actor(caller),
    )
    ctx = request.app.state.ctx
    timeout_s = ctx.settings.promote_timeout_s
    return await bus_request(ctx.nc, subjects.registry("promote"), message, AdapterRecordsReply, timeout_s)


@router.post("/{adapter_id}/eval-set", response_model=AdapterRecordsReply, responses=CHANGE_ERRORS)
async def attach_eval_set(
    body: AttachEvalSet, request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    """Attach (or replace) a version's eval set, which the release gate runs on a worker; audited with its digest."""
    await owned(request, caller, adapter_id)
    message = AttachEvalSetRequest(
        adapter_id=adapter_id,
        version=body.version,
        eval_set=body.eval_set,
        tenant_id=None if caller.platform_admin else caller.tenant_id,
        actor=actor(caller),
    )
    return await registry_call(request, "attach_eval_set", message, AdapterRecordsReply)


@router.post("/{adapter_id}/rollout", response_model=AdapterRecordsReply, responses=CHANGE_ERRORS)
async def rollout(
    body: Rollout, request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    await owned(request, caller, adapter_id)
    message = RolloutRequest(adapter_id=adapter_id, traffic_percent=body.traffic_percent, actor=actor(caller))
    return await registry_call(request, "rollout", message, AdapterRecordsReply)


@router.post("/{adapter_id}/rollback", response_model=AdapterRecordsReply, responses=CHANGE_ERRORS)
async def rollback(
    request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    await owned(request, caller, adapter_id)
    return await registry_call(
        request, "rollback", RollbackRequest(adapter_id=adapter_id, actor=actor(caller)), AdapterRecordsReply
    )


@router.post("/{adapter_id}/retire", response_model=AdapterRecordsReply, responses=CHANGE_ERRORS)
async def retire(
    body: Retire, request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    await owned(request, caller, adapter_id)
    message = RetireRequest(adapter_id=adapter_id, version=body.version, actor=actor(caller))
    return await registry_call(request, "retire", message, AdapterRecordsReply)


@router.post("/{adapter_id}/revoke", response_model=AdapterRecordsReply, responses=CHANGE_ERRORS)
async def revoke(
    body: Revoke, request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> AdapterRecordsReply:
    """Security stop: one version, or every version when version is null."""
    await owned(request, caller, adapter_id)
    message = RevokeRequest(adapter_id=adapter_id, version=body.version, actor=actor(caller))
    return await registry_call(request, "revoke", message, AdapterRecordsReply)


@router.get("/{adapter_id}/pins", response_model=PinsReply, responses=ERRORS)
async def list_pins(
    request: Request, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> PinsReply:
    """The adapter's pins: which version (null = the served one) on which worker (null = every worker)."""
    await owned(request, caller, adapter_id)
    return await registry_call(request, "pins", ListPinsRequest(adapter_id=adapter_id), PinsReply)


@router.post("/{adapter_id}/pin", response_model=PinsReply, responses=CHANGE_ERRORS)
async def pin(
    request: Request, body: Pin | None = None, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> PinsReply:
    """Keep the adapter in a GPU slot on one worker or every worker; 409 pins_exceed_slots when the pins of
    its rank class would hold every slot of a worker but one."""
    return await registry_call(request, "pin", _pin_request(body, adapter_id, caller), PinsReply)


@router.post("/{adapter_id}/unpin", response_model=PinsReply, responses=CHANGE_ERRORS)
async def unpin(
    request: Request, body: Pin | None = None, adapter_id: str = AdapterId, caller: Principal = Depends(admin_caller)
) -> PinsReply:
    """Remove the pin with exactly this version and worker (404 when there is none): the adapter is evictable again."""
    return await registry_call(request, "unpin", _pin_request(body, adapter_id, caller), PinsReply)


def _pin_request(body: Pin | None, adapter_id: str, caller: Principal) -> PinRequest:
    """The registry checks the caller owns the adapter: a tenant admin names its tenant, a platform admin none."""
    body = body or Pin()
    return PinRequest(
        adapter_id=adapter_id,
        version=body.version,
        worker_id=body.worker,
        tenant_id=None if caller.platform_admin else caller.tenant_id,
        actor=actor(caller),
    )
