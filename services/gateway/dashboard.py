"""/dashboard: a live, admin-scoped view of adapters, workers, cache hit rate, TTFT and the audit trail.

A platform admin sees every tenant; a tenant admin sees only its own adapters, traffic and records."""

import time
from pathlib import Path
from typing import TypeVar

import structlog
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
from shared.errors import LorafleetError
from shared.schemas import (
    AdapterRecordsReply,
    AuditQueryReply,
    AuditQueryRequest,
    ExperimentStatusReply,
    GetExperimentRequest,
    ListAdaptersRequest,
)

M = TypeVar("M", bound=BaseModel)
router = APIRouter()
log = structlog.get_logger("gateway")
PAGE = (Path(__file__).parent / "static" / "dashboard.html").read_text()
WINDOW_S = 900.0
MAX_COMPLETIONS = 5000  # the traffic panels summarise at most the newest this many of the window
RECENT = 25
EXPERIMENTS = 10  # the newest experiments whose per-arm figures the page shows


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
        """A piece that is down or failing leaves its panels empty and is named, instead of failing the page."""
        try:
            return await bus_request(ctx.nc, subject, message, reply, timeout)
        except LorafleetError as e:
            log.warning("dashboard_piece_unavailable", piece=piece, code=e.code, error=e.message)
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
    completions: list[dict] = []
    page = AuditQueryRequest(tenant_id=tenant, kind="completion", since=since, limit=1000)
    while len(completions) < MAX_COMPLETIONS:
        reply = await ask(subjects.AUDITOR_QUERY, page, AuditQueryReply, AuditQueryReply(), "auditor")
        completions.extend(reply.records)
        if reply.next_cursor is None:
            break
        page = page.model_copy(update={"before": reply.next_cursor})
    completions.reverse()  # oldest first, as the time series runs
    recent = await ask(
        subjects.AUDITOR_QUERY,
        AuditQueryRequest(tenant_id=tenant, since=since, limit=RECENT),
        AuditQueryReply,
        AuditQueryReply(),
        "auditor",
    )
    shown = sorted(
        (e for (owner, _), e in ctx.catalog.routes.experiments.items() if tenant in (None, owner)),
        key=lambda e: -e.started_at,
    )[:EXPERIMENTS]
    statuses = [
        await ask(
            subjects.registry("experiment_status"),
            GetExperimentRequest(tenant_id=e.tenant_id, name=e.name),
            ExperimentStatusReply,
            ExperimentStatusReply(experiment=e, arms=[]),
            "registry",
        )
        for e in shown
    ]
    workers = dashboard_data.workers(ctx.cluster.ready_workers())
    if tenant is not None:
        own = {r.adapter_id for r in records}
        for row in (*completions, *recent.records):
            row.update(dashboard_data.told_hit(row, own))
        for w in workers:
            w["gpu_adapters"] = [k for k in w["gpu_adapters"] if adapter_of_key(k) in own]
            w["cpu_adapters"] = [k for k in w["cpu_adapters"] if adapter_of_key(k) in own]
    return {
        "traffic": dashboard_data.traffic(completions),
        "workers": workers,
        "adapters": dashboard_data.adapters(records),
        "experiments": dashboard_data.experiments(statuses),
        "audit": recent.records,
        "audit_intact": recent.chain.intact if recent.chain else None,
        "unavailable": sorted(set(missing)),
        "checks_off": ctx.cluster.checks_off(),
    }
