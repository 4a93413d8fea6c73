"""Admin API for task routes and routing policies (each a registry op), and ``/admin/route/explain``.

An ``admin`` key manages its own tenant's routes and policies; a ``platform_admin`` key any
tenant's, and the platform-wide policies. Explain runs the gateway's own routing step (the one the
scheduler runs too) and the normal resolve, and says which rule matched and what is served.
"""

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.admin import ERRORS, actor, registry_call, require_platform, scoped_tenant
from services.gateway.auth import Principal, admin_caller
from services.gateway.openai_responses import error_responses
from shared.catalog.policy import RequestFacts
from shared.catalog.routing import AUTO
from shared.errors import LorafleetError, RoutePolicyRefused
from shared.schemas import (
    MAX_ROUTES,
    MAX_RULES,
    TASK_PATTERN,
    DeleteRoutesRequest,
    GetPoliciesRequest,
    GetRoutesRequest,
    Identifier,
    PoliciesReply,
    PolicyRule,
    ResolveRequest,
    RouteExplanation,
    RouteFacts,
    RoutesReply,
    RouteTarget,
    SetPoliciesRequest,
    SetRoutesRequest,
    SloClass,
    check_metadata,
)
from shared.schemas.registry import MODEL_NAME_MAX

router = APIRouter(prefix="/admin", tags=["admin"])
WRITE_ERRORS = error_responses(409, *(s for s in (400, 401, 403, 404, 413, 503, 504)))


class RoutesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier | None = Field(default=None, description="default: the caller's tenant")
    routes: dict[str, RouteTarget] = Field(max_length=MAX_ROUTES, description="task -> adapter; replaces the table")


class PoliciesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier | None = Field(default=None, description="default: the caller's tenant")
    platform: bool = Field(default=False, description="the platform-wide rules (platform_admin only)")
    rules: list[PolicyRule] = Field(max_length=MAX_RULES, description="in order; replaces the set")


class ExplainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant_id: Identifier | None = Field(default=None, description="default: the caller's tenant")
    model: str = Field(default=AUTO, min_length=1, max_length=MODEL_NAME_MAX)
    task: str | None = Field(default=None, pattern=TASK_PATTERN, description="the x-lorafleet-task header")
    key_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    tier: SloClass | None = Field(default=None, description="default: the tenant's")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=16)
    headers: dict[str, str] = Field(default_factory=dict, max_length=16)
    user: str | None = Field(default=None, min_length=1, max_length=256, description="what an experiment splits by")

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str]) -> dict[str, str]:
        check_metadata(metadata)
        return metadata

    @field_validator("headers")
    @classmethod
    def _headers(cls, headers: dict[str, str]) -> dict[str, str]:
        return RouteFacts(headers=headers).headers  # the bounds a submission's carried headers have


def _tenant(caller: Principal, tenant_id: str | None) -> str:
    return scoped_tenant(caller, tenant_id) or caller.tenant_id


@router.get("/routes", response_model=RoutesReply, responses=ERRORS)
async def get_routes(
    request: Request, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> RoutesReply:
    """The tenant's task routing table (task -> adapter) and its revision."""
    return await registry_call(request, "routes", GetRoutesRequest(tenant_id=_tenant(caller, tenant)), RoutesReply)


@router.put("/routes", response_model=RoutesReply, responses=WRITE_ERRORS)
async def set_routes(body: RoutesBody, request: Request, caller: Principal = Depends(admin_caller)) -> RoutesReply:
    """Replace the tenant's task routes; each adapter must be one the tenant may call (else 404). Audited."""
    message = SetRoutesRequest(tenant_id=_tenant(caller, body.tenant_id), routes=body.routes, actor=actor(caller))
    return await registry_call(request, "routes_set", message, RoutesReply)


@router.delete("/routes", response_model=RoutesReply, responses=WRITE_ERRORS)
async def delete_routes(
    request: Request, tenant: Identifier | None = None, caller: Principal = Depends(admin_caller)
) -> RoutesReply:
    """Delete every task route of the tenant. Audited."""
    message = DeleteRoutesRequest(tenant_id=_tenant(caller, tenant), actor=actor(caller))
    return await registry_call(request, "routes_delete", message, RoutesReply)


@router.delete("/routes/{task}", response_model=RoutesReply, responses=WRITE_ERRORS)
async def delete_route(
    request: Request,
    task: str = Path(pattern=TASK_PATTERN),
    tenant: Identifier | None = None,
    caller: Principal = Depends(admin_caller),
) -> RoutesReply:
    """Delete one task route (404 if the tenant has none for it). Audited."""
    message = DeleteRoutesRequest(tenant_id=_tenant(caller, tenant), task=task, actor=actor(caller))
    return await registry_call(request, "routes_delete", message, RoutesReply)


@router.get("/policies", response_model=PoliciesReply, responses=ERRORS)
async def get_policies(
    request: Request,
    tenant: Identifier | None = None,
    platform: bool = False,
    caller: Principal = Depends(admin_caller),
) -> PoliciesReply:
    """The tenant's routing rules in order (or, for a platform admin, the platform-wide ones)."""
    if platform:
        require_platform(caller)
    message = GetPoliciesRequest(tenant_id=None if platform else _tenant(caller, tenant))
    return await registry_call(request, "policies", message, PoliciesReply)


@router.put("/policies", response_model=PoliciesReply, responses=WRITE_ERRORS)
async def set_policies(
    body: PoliciesBody, request: Request, caller: Principal = Depends(admin_caller)
) -> PoliciesReply:
    """Replace the tenant's (or the platform's) ordered routing rules; an empty list deletes them. Audited."""
    if body.platform:
        require_platform(caller)
    tenant_id = None if body.platform else _tenant(caller, body.tenant_id)
    message = SetPoliciesRequest(tenant_id=tenant_id, rules=body.rules, actor=actor(caller))
    return await registry_call(request, "policies_set", message, PoliciesReply)


@router.get("/route/explain", response_model=RouteExplanation, responses=ERRORS)
async def explain_get(
    request: Request,
    model: str = Query(default=AUTO, min_length=1, max_length=MODEL_NAME_MAX),
    task: str | None = Query(default=None, pattern=TASK_PATTERN),
    key_id: str | None = Query(default=None, pattern=r"^[0-9a-f]{16}$"),
    tenant: Identifier | None = None,
    caller: Principal = Depends(admin_caller),
) -> RouteExplanation:
    """Which rule a request with these facts matches and what it is served by (no metadata or headers:
    POST for those)."""
    return await explain(request, ExplainBody(tenant_id=tenant, model=model, task=task, key_id=key_id), caller)


@router.post("/route/explain", response_model=RouteExplanation, responses=ERRORS)
async def explain(request: Request, body: ExplainBody, caller: Principal = Depends(admin_caller)) -> RouteExplanation:
    """Which rule a request with these facts matches and what it is served by; a refusal (a rule's,
    a missing task route, an unknown model) is answered as ``refused`` with its error code."""
    ctx = request.app.state.ctx
    tenant_id = _tenant(caller, body.tenant_id)
    facts = RequestFacts(
        tier=body.tier or ctx.keys.tier(tenant_id),
        key_id=body.key_id,
        model=body.model,
        metadata=body.metadata,
        headers=body.headers,
        request_key=body.user or "explain",
    )
    said = RouteExplanation(tenant_id=tenant_id, requested=body.model)
    try:
        routed = ctx.catalog.route(tenant_id, body.model, body.task, facts)
    except RoutePolicyRefused as e:
        return said.model_copy(update={"rule": e.rule, "rule_scope": e.scope, "refused": e.code, "message": e.message})
    except LorafleetError as e:
        return said.model_copy(update={"refused": e.code, "message": e.message})
    said = said.model_copy(
        update={
            "rule": routed.rule,
            "rule_scope": routed.scope,
            "task": routed.task,
            "model": routed.model,
            "experiment": routed.experiment,
            "arm": routed.arm,
        }
    )
    try:
        resolved = await ctx.catalog.resolve(
            ResolveRequest(tenant_id=tenant_id, model=routed.model, request_key=body.user or "explain")
        )
    except LorafleetError as e:
        return said.model_copy(update={"refused": e.code, "message": e.message})
    adapter = resolved.adapter
    return said.model_copy(
        update={
            "adapter_id": adapter.adapter_id if adapter else None,
            "adapter_version": adapter.version if adapter else None,
        }
    )
