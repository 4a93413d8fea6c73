"""Scheduler process: consume the INFER work queue, place each request on a live worker."""

import asyncio
import contextlib

import structlog
from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig
from nats.errors import TimeoutError as NatsTimeout

from services.scheduler.heat import HeatCounter
from services.scheduler.submission import Outcome, Ports, handle
from shared import subjects
from shared.bus import connect, decode, encode, ensure_streams, request, shutdown_event
from shared.config import SchedulerSettings
from shared.errors import LorafleetError
from shared.heartbeat import publish_heartbeats
from shared.metrics import serve_metrics
from shared.liveness import Liveness
from shared.logs import configure_logging
from shared.telemetry import continued, setup_tracing, tracer
from shared.redis_conn import connect_redis
from shared.schemas import (
    AuditEnvelope, DispatchReply, InferRequest, RejectionAudit, ReplyEnvelope, ReplyError, WorkerHeartbeat,
)

CONSUMER = "scheduler"


def _ports(nc: NATS, js, workers: Liveness[WorkerHeartbeat], settings: SchedulerSettings, msg) -> Ports:
    async def dispatch(worker_id: str, req: InferRequest) -> DispatchReply:
        return await request(nc, subjects.worker_dispatch(worker_id), req, DispatchReply,
                             settings.dispatch_timeout_s)

    async def reply_error(reply_to: str, request_id: str, err: LorafleetError) -> None:
        body = ReplyEnvelope(body=ReplyError(request_id=request_id, error=err.to_body()))
        await nc.publish(reply_to, encode(body))

    async def record_rejection(tenant: str, request_id: str, err: LorafleetError) -> None:
        try:
            event = RejectionAudit(request_id=request_id, tenant_id=subjects.token(tenant), service="scheduler",
                                   code=err.code, reason=err.message)
            await js.publish(subjects.audit("rejection", tenant), encode(AuditEnvelope(body=event)))
        except Exception as e:
            structlog.get_logger("scheduler").warning("audit_publish_failed", error=str(e))

    return Ports(workers=lambda: list(workers.alive().values()), dispatch=dispatch, reply_error=reply_error,
                 keep_alive=msg.in_progress, record_rejection=record_rejection)


async def run(settings: SchedulerSettings) -> None:
    log = configure_logging("scheduler", settings.log_level)
    setup_tracing("scheduler", settings.trace_exporter)
    span_tracer = tracer("scheduler")
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"scheduler-{settings.instance_id}")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        workers: Liveness[WorkerHeartbeat] = Liveness(settings.liveness_timeout_s)
        heat = HeatCounter(connect_redis(settings.redis_url, password=settings.redis_password()), settings.redis_key_prefix)
        stack.push_async_callback(heat.close)

        async def on_worker(msg) -> None:
            try:
                beat = decode(WorkerHeartbeat, msg.data)
                workers.seen(beat.worker_id, beat)
            except LorafleetError as e:
                log.warning("bad_worker_heartbeat", error=e.message)

        await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=on_worker)
        psub = await js.pull_subscribe(
            subjects.INFER_SUBMIT_ALL, durable=CONSUMER, stream=subjects.INFER_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5),
        )
        slots = asyncio.Semaphore(settings.max_inflight)
        tasks: set[asyncio.Task] = set()

        async def process(msg) -> None:
            try:
                with continued(msg.headers), span_tracer.start_as_current_span("scheduler.place"):
                    outcome = await handle(msg.subject, msg.data, _ports(nc, js, workers, settings, msg),
                                           settings.no_worker_grace_s)
                if outcome is Outcome.DISPATCHED:
                    await msg.ack()
                    await heat.bump(msg.data)
                else:
                    await msg.term()
            except Exception:
                log.exception("submission_crashed", subject=msg.subject)
                await msg.nak(delay=1)
            finally:
                slots.release()

        def status() -> tuple[bool, str]:
            alive = [w for w in workers.alive().values() if w.ready]
            detail = f"{len(alive)} workers" + ("" if heat.healthy else ", redis unavailable")
            return nc.is_connected, detail

        stop = shutdown_event()
        metrics_port = serve_metrics(settings.metrics_port, settings.metrics_host)
        beats = asyncio.create_task(publish_heartbeats(nc, "scheduler", settings.instance_id,
                                                       settings.heartbeat_interval_s, status, metrics_port))
        log.info("scheduler_started")
        while not stop.is_set():
            try:
                msgs = await psub.fetch(batch=16, timeout=0.5)
            except NatsTimeout:
                continue
            except Exception as e:
                log.warning("fetch_failed", error=str(e))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                await slots.acquire()
                task = asyncio.create_task(process(msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        beats.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        log.info("scheduler_stopped")


def main() -> None:
    asyncio.run(run(SchedulerSettings()))
