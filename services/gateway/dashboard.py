"""/dashboard: a live, admin-scoped view of adapters, workers, cache hit rate, TTFT and the audit trail.

A platform admin sees every tenant; a tenant admin sees only its own adapters, traffic and records."""

import time
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse

from services.gateway import dashboard_data
from services.gateway.auth import Principal, principal
from services.gateway.context import GatewayContext
from shared import subjects
from shared.bus import request as bus_request
from shared.schemas import AdapterRecordsReply, AuditQueryReply, AuditQueryRequest, ListAdaptersRequest

router = APIRouter()
PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text()
WINDOW_S = 900.0


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
async def dashboard_page() -> HTMLResponse:
    """The page holds no data; it asks for an admin key and polls /dashboard/data with it."""
    return HTMLResponse(PAGE)


@router.get("/dashboard/data", tags=["admin"], summary="live dashboard data (admin scope)")
async def dashboard_json(request: Request, caller: Principal = Depends(principal)) -> dict:
    caller.require("admin")
    ctx: GatewayContext = request.app.state.ctx
    tenant = None if caller.platform_admin else caller.tenant_id
    timeout = ctx.settings.registry_timeout_s
    records = (await bus_request(ctx.nc, subjects.registry("adapters"), ListAdaptersRequest(tenant_id=tenant),
                                 AdapterRecordsReply, timeout)).records
    completions = await bus_request(ctx.nc, subjects.AUDITOR_QUERY, AuditQueryRequest(
        tenant_id=tenant, kind="completion", since=time.time() - WINDOW_S, limit=1000), AuditQueryReply, timeout)
    recent = await bus_request(ctx.nc, subjects.AUDITOR_QUERY, AuditQueryRequest(
        tenant_id=tenant, since=time.time() - WINDOW_S, limit=1000), AuditQueryReply, timeout)
    workers = dashboard_data.workers(ctx.cluster.ready_workers())
    if tenant is not None:
        own = {r.adapter_id for r in records}
        for w in workers:
            w["gpu_adapters"] = [k for k in w["gpu_adapters"] if k.rpartition("@")[0] in own]
            w["cpu_adapters"] = [k for k in w["cpu_adapters"] if k.rpartition("@")[0] in own]
    return {
        "traffic": dashboard_data.traffic(completions.records),
        "workers": workers,
        "adapters": dashboard_data.adapters(records),
        "audit": recent.records[-25:][::-1],
        "audit_intact": completions.intact,
    }
