"""/dashboard: a live, admin-scoped view of adapters, workers, cache hit rate, TTFT and the audit trail.

A platform admin sees every tenant; a tenant admin sees only its own adapters, traffic and records."""

import time
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from services.gateway import dashboard_data
from services.gateway.auth import Principal, admin_caller
from services.gateway.context import GatewayContext
from services.gateway.openai_responses import error_responses
from shared import subjects
from shared.adapter_keys import adapter_of_key
from shared.bus import request as bus_request
from shared.errors import ServiceUnavailable, UpstreamTimeout
from shared.schemas import AdapterRecordsReply, AuditQueryReply, AuditQueryRequest, ListAdaptersRequest

M = TypeVar("M", bound=BaseModel)
router = APIRouter()
PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text()
WINDOW_S = 900.0


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    """The page holds no data; it asks for an admin key and polls /dashboard/data with it."""
    return HTMLResponse(PAGE)


@router.get(
    "/dashboard/data", tags=["admin"], summary="live dashboard data (admin scope)", responses=error_responses(401, 403)
)
async def dashboard_json(request: Request, caller: Principal = Depends(admin_caller)) -> dict:
    ctx: GatewayContext = request.app.state.ctx
    tenant = None if caller.platform_admin else caller.tenant_id
    timeout = ctx.settings.registry_timeout_s
    missing: list[str] = []

    async def ask(subject: str, message: BaseModel, reply: type[M], empty: M, piece: str) -> M:
        """A piece that is down leaves its panels empty and is named, instead of failing the page."""
        try:
            return await bus_request(ctx.nc, subject, message, reply, timeout)
        except (ServiceUnavailable, UpstreamTimeout):
            missing.append(piece)
            return empty

    records = (
        await ask(
            subjects.registry("adapters"),
            ListAdaptersRequest(tenant_id=tenant),
            AdapterRecordsReply,
            AdapterRecordsReply(),
            "registry",
        )
    ).records
    since = time.time() - WINDOW_S
    completions = await ask(
        subjects.AUDITOR_QUERY,
        AuditQueryRequest(tenant_id=tenant, kind="completion", since=since, limit=1000),
        AuditQueryReply,
        AuditQueryReply(),
        "auditor",
    )
    recent = await ask(
        subjects.AUDITOR_QUERY,
        AuditQueryRequest(tenant_id=tenant, since=since, limit=1000),
        AuditQueryReply,
        AuditQueryReply(),
        "auditor",
    )
    workers = dashboard_data.workers(ctx.cluster.ready_workers())
    if tenant is not None:
        own = {r.adapter_id for r in records}
        for w in workers:
            w["gpu_adapters"] = [k for k in w["gpu_adapters"] if adapter_of_key(k) in own]
            w["cpu_adapters"] = [k for k in w["cpu_adapters"] if adapter_of_key(k) in own]
    return {
        "traffic": dashboard_data.traffic(completions.records),
        "workers": workers,
        "adapters": dashboard_data.adapters(records),
        "audit": recent.records[-25:][::-1],
        "audit_intact": completions.intact,
        "unavailable": sorted(set(missing)),
    }
