"""The dispatcher's ports onto NATS: dispatch to a worker, control messages, error replies, registry records."""

import asyncio
import math
import time
import uuid

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from services.scheduler.dispatcher import Ports
from services.scheduler.settings import SchedulerSettings
from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import (
    encode,
    request,
)
from shared.catalog.grants import IsolationAttempt
from shared.catalog.view import CatalogView
from shared.errors import LorafleetError, NoResponders, UpstreamTimeout
from shared.schemas import (
    DispatchReply,
    InferRequest,
    RejectionAudit,
    ReplyEnvelope,
    ReplyError,
    WorkerControl,
)
from shared.telemetry import continued, tracer

RECONNECT_POLL_S = 0.25
_tracer = tracer("scheduler")


def bus_ports(nc: NATS, js: JetStreamContext, settings: SchedulerSettings, catalog: CatalogView) -> Ports:
    audits: set[asyncio.Task] = set()  # rejection records still being published

    async def dispatch(worker_id: str, req: InferRequest, headers: dict[str, str] | None) -> DispatchReply:
        """The worker's answer. A wait that overlapped a lost connection says nothing about the worker (it may
        have taken the request, only its reply lost, and withdrawing it would run it twice): the same worker
        is asked again once connected, its accept being idempotent, until the request's accept deadline
        (a worker whose dispatch subscription is not back yet is asked again too, not judged absent)."""
        with (
            continued(headers),
            _tracer.start_as_current_span(
                "scheduler.place", attributes={"lf.request_id": req.request_id, "lf.worker_id": worker_id}
            ),
        ):

            def expired() -> bool:
                return req.accept_deadline is not None and time.time() > req.accept_deadline

            ambiguous_since: float | None = None  # when a wait first overlapped a lost connection
            while True:
                reconnects = nc.stats["reconnects"]
                try:
                    return await request(
                        nc, subjects.worker_dispatch(worker_id), req, DispatchReply, settings.dispatch_timeout_s
                    )
                except UpstreamTimeout:
                    if expired() or (nc.is_connected and nc.stats["reconnects"] == reconnects):
                        raise
                    ambiguous_since = ambiguous_since or time.monotonic()
                except NoResponders:
                    # after an ambiguous wait, the worker may hold the request while its own subscription
                    # is not back yet: asked again until it answers, the deadline passes, or it would be
                    # judged lost anyway
                    waited = time.monotonic() - (ambiguous_since or -math.inf)
                    if expired() or waited > settings.liveness_timeout_s:
                        raise
                    await asyncio.sleep(RECONNECT_POLL_S)
                # nats-py announces a reconnect only to the callbacks given to connect(): poll for it
                while not nc.is_connected and not expired():  # noqa: ASYNC110
                    await asyncio.sleep(RECONNECT_POLL_S)

    async def reply_error(reply_to: str, request_id: str, err: LorafleetError) -> None:
        await nc.publish(reply_to, encode(ReplyEnvelope(body=ReplyError(request_id=request_id, error=err.to_body()))))

    async def record_rejection(tenant: str, request_id: str, err: LorafleetError) -> None:
        """Audited beside the submission loop: a NATS outage retries it without holding admission up."""
        event = RejectionAudit(
            request_id=request_id,
            tenant_id=subjects.token(tenant),
            service="scheduler",
            code=err.code,
            reason=err.message,
            route="nats" if isinstance(err, IsolationAttempt) else None,
        )
        task = asyncio.create_task(publish_audit(js, event, f"rejection.scheduler.{uuid.uuid4().hex}"))
        audits.add(task)
        task.add_done_callback(audits.discard)

    async def control(worker_id: str, message: WorkerControl) -> None:
        await nc.publish(subjects.worker_control(worker_id), encode(message))

    return Ports(dispatch, reply_error, record_rejection, control, catalog)
