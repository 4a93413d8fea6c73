"""Handle one submission: check it, place it on a worker, and say whether to ack or drop it.

Everything that touches NATS is injected, so this logic is tested with plain callables."""

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

import structlog

from services.scheduler.placement import rank_workers
from shared import subjects
from shared.bus import decode
from shared.errors import Forbidden, InvalidMessage, LorafleetError, NoWorkerAvailable, UpstreamTimeout, from_body
from shared.schemas import DispatchReply, InferRequest, WorkerHeartbeat

log = structlog.get_logger("scheduler")


class Outcome(Enum):
    DISPATCHED = "dispatched"  # a worker owns it now: ack
    REFUSED = "refused"  # answered with an error: ack (terminate), never redeliver
    EXPIRED = "expired"  # the client stopped waiting: terminate quietly


@dataclass(slots=True)
class Ports:
    """The scheduler's view of the outside world for one submission."""

    workers: Callable[[], list[WorkerHeartbeat]]
    dispatch: Callable[[str, InferRequest], Awaitable[DispatchReply]]
    reply_error: Callable[[str, str, LorafleetError], Awaitable[None]]
    keep_alive: Callable[[], Awaitable[None]]
    record_rejection: Callable[[str, str, LorafleetError], Awaitable[None]]


def parse_submission(subject: str, data: bytes) -> InferRequest:
    """The request, checked against the subject's tenant: nobody submits as another tenant."""
    request = decode(InferRequest, data)
    if subjects.tenant_of_submit(subject) != request.tenant_id:
        raise Forbidden("a request's tenant must match the tenant of its submit subject")
    if request.reply_to.startswith("_INBOX_") and not request.reply_to.startswith(f"_INBOX_{request.tenant_id}."):
        raise Forbidden("replies may only go to the requesting tenant's own inbox")
    return request


def reply_target(data: bytes) -> tuple[str, str] | None:
    """Best effort (request_id, reply_to) from a message that failed validation."""
    try:
        raw = json.loads(data)
        rid, reply = raw.get("request_id"), raw.get("reply_to")
    except (ValueError, AttributeError):
        return None
    if isinstance(rid, str) and isinstance(reply, str) and reply.startswith("_INBOX.") and "*" not in reply \
            and ">" not in reply:
        return rid[:128], reply
    return None


async def handle(subject: str, data: bytes, ports: Ports, no_worker_grace_s: float) -> Outcome:
    try:
        request = parse_submission(subject, data)
    except (InvalidMessage, Forbidden, ValueError) as e:
        err = e if isinstance(e, LorafleetError) else InvalidMessage(str(e))
        target = reply_target(data)
        log.warning("submission_refused", subject=subject, error=err.message)
        if target:
            await ports.reply_error(target[1], target[0], err)
        tenant = subject.rsplit(".", 1)[-1]
        await ports.record_rejection(tenant, target[0] if target else "unknown", err)
        return Outcome.REFUSED
    if request.accept_deadline is not None and time.time() > request.accept_deadline:
        log.info("submission_expired", request_id=request.request_id)
        return Outcome.EXPIRED
    return await _place(request, ports, no_worker_grace_s)


async def _place(request: InferRequest, ports: Ports, no_worker_grace_s: float) -> Outcome:
    tried: set[str] = set()
    deadline = time.monotonic() + no_worker_grace_s
    last_error: LorafleetError = NoWorkerAvailable("no live worker serves this base model")
    while True:
        for worker in rank_workers(request, ports.workers(), tried):
            tried.add(worker.worker_id)
            try:
                reply = await ports.dispatch(worker.worker_id, request)
            except LorafleetError as e:
                log.warning("dispatch_failed", worker_id=worker.worker_id, error=e.message)
                last_error = e if not isinstance(e, UpstreamTimeout) else last_error
                continue
            if reply.accepted:
                log.info("dispatched", request_id=request.request_id, worker_id=worker.worker_id)
                return Outcome.DISPATCHED
            if reply.error is not None and reply.error.status < 500:
                err = from_body(reply.error)
                await ports.reply_error(request.reply_to, request.request_id, err)
                await ports.record_rejection(request.tenant_id, request.request_id, err)
                return Outcome.REFUSED
        if time.monotonic() >= deadline:
            break
        await ports.keep_alive()
        await asyncio.sleep(0.1)
        tried.clear()
    await ports.reply_error(request.reply_to, request.request_id, last_error)
    await ports.record_rejection(request.tenant_id, request.request_id, last_error)
    return Outcome.REFUSED
