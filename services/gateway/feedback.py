"""POST /v1/feedback: a user's rating of one of its own completions, fed to the release controller.

The request must be the caller's own: its completion record is looked up in the audit index under
the caller's tenant (never a tenant or version named in the body), so another tenant's request id
answers the same 404 as one that never existed. Each post is a request of the tenant's, charged
to its requests-per-minute quota by the scheduler (429 beyond it). The rating is recorded as a
FeedbackAudit naming the adapter version that served the request."""

import asyncio
import time
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.auth import Principal, inference_caller
from services.gateway.context import GatewayContext
from services.gateway.openai_responses import error_responses
from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import request as bus_request
from shared.errors import RequestNotFound, ServiceUnavailable
from shared.schemas import AuditQueryReply, AuditQueryRequest, ChargeReply, ChargeRequest, FeedbackAudit, RequestId

router = APIRouter(tags=["feedback"])
LOOKUP_PAUSE_S = 0.1
PUBLISH_ATTEMPTS = 2  # an HTTP caller waits for this: a short retry, then a 503 it may retry itself


class FeedbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request_id: RequestId = Field(description="the x-lorafleet-request-id of the rated completion")
    rating: Literal["up", "down"]
    reason: str | None = Field(default=None, max_length=1000)


class FeedbackRecorded(BaseModel):
    object: Literal["feedback"] = "feedback"
    request_id: str
    rating: Literal["up", "down"]
    model: str | None = Field(description="the adapter version that served the request")


async def own_completion(ctx: GatewayContext, tenant_id: str, request_id: str) -> dict:
    """The caller's completion record of ``request_id``, waiting up to ``feedback_lookup_s`` for the
    auditor to index it; RequestNotFound when the tenant has none (another tenant's id included)."""
    query = AuditQueryRequest(tenant_id=tenant_id, request_id=request_id, kind="completion", limit=1)
    deadline = time.monotonic() + ctx.settings.feedback_lookup_s
    while True:
        reply = await bus_request(
            ctx.nc, subjects.AUDITOR_QUERY, query, AuditQueryReply, ctx.settings.registry_timeout_s
        )
        if reply.records and reply.records[0].get("shadow_of") is None:  # a shadow run served no one to rate
            return reply.records[0]
        if time.monotonic() >= deadline:
            raise RequestNotFound(f"no completion {request_id!r} of this tenant", param="request_id")
        await asyncio.sleep(LOOKUP_PAUSE_S)


@router.post(
    "/v1/feedback", response_model=FeedbackRecorded, responses=error_responses(400, 401, 403, 404, 429, 503, 504)
)
async def feedback(request: Request, body: FeedbackBody, caller: Principal = Depends(inference_caller)):
    ctx: GatewayContext = request.app.state.ctx
    charge = ChargeRequest(tenant_id=caller.tenant_id, kind="feedback")  # a request like any other: 429 past the quota
    await bus_request(ctx.nc, subjects.SCHEDULER_CHARGE, charge, ChargeReply, ctx.settings.registry_timeout_s)
    completion = await own_completion(ctx, caller.tenant_id, body.request_id)
    event = FeedbackAudit(
        request_id=body.request_id,
        tenant_id=caller.tenant_id,
        adapter_id=completion.get("adapter_id"),
        adapter_version=completion.get("adapter_version"),
        rating=body.rating,
        reason=body.reason,
    )
    # one record per (tenant, request, rating) within the stream's duplicate window: a client posting
    # the same rating again and again writes it once (a changed mind is a new record)
    msg_id = f"feedback.{caller.tenant_id}.{body.request_id}.{body.rating}"
    if not await publish_audit(ctx.js, event, msg_id, attempts=PUBLISH_ATTEMPTS):
        raise ServiceUnavailable("the feedback could not be recorded; try again")
    model = f"{event.adapter_id}@{event.adapter_version}" if event.adapter_id else None
    return FeedbackRecorded(request_id=body.request_id, rating=body.rating, model=model)
