"""Scheduler process: fetch the INFER work queue, admit, queue fairly, place on live workers."""

import asyncio
import contextlib
import time
import uuid

import structlog
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BucketNotFoundError

from services.scheduler.admission import Admission
from services.scheduler.dedupe import Dispatched
from services.scheduler.dispatcher import Dispatcher, Ports
from services.scheduler.fairness import FairQueue
from services.scheduler.heat import Heat
from services.scheduler.limits import Quotas
from services.scheduler.placement import Fleet
from services.scheduler.prefetch import Prefetcher
from services.scheduler.redis_guard import RedisGuard
from services.scheduler.upkeep import Periods, Upkeep
from shared import event_loop, subjects
from shared.audit_publish import publish_audit
from shared.bus import (
    connect,
    decode,
    encode,
    ensure_streams,
    follow,
    request,
    shutdown_event,
)
from shared.config import SchedulerSettings, load_settings
from shared.errors import LorafleetError, UpstreamTimeout
from shared.heartbeat import publish_heartbeats
from shared.logs import configure_logging
from shared.metrics import QUEUE_DEPTH, serve_metrics
from shared.redis_conn import connect_redis
from shared.registry_client import fetch_record
from shared.schemas import (
    AdapterRecord,
    AuditEnvelope,
    CompletionAudit,
    DispatchReply,
    InferRequest,
    RejectionAudit,
    ReplyEnvelope,
    ReplyError,
    WorkerControl,
    WorkerHeartbeat,
)
from shared.telemetry import continued, setup_tracing, tracer

CONSUMER = "scheduler"
ACK_WAIT_S = 30
TICK_S = 0.25
log = structlog.get_logger("scheduler")
_tracer = tracer("scheduler")


def _ports(nc: NATS, js: JetStreamContext, settings: SchedulerSettings) -> Ports:
    audits: set[asyncio.Task] = set()  # rejection records still being published

    async def dispatch(worker_id: str, req: InferRequest, headers: dict[str, str] | None) -> DispatchReply:
        """The worker's answer. A wait that overlapped a lost connection says nothing about the worker (it may
        have taken the request, only its reply lost, and withdrawing it would run it twice): the same worker
        is asked again once connected, its accept being idempotent, until the request's accept deadline."""
        with (
            continued(headers),
            _tracer.start_as_current_span(
                "scheduler.place", attributes={"lf.request_id": req.request_id, "lf.worker_id": worker_id}
            ),
        ):

            def expired() -> bool:
                return req.accept_deadline is not None and time.time() > req.accept_deadline

            while True:
                reconnects = nc.stats["reconnects"]
                try:
                    return await request(
                        nc, subjects.worker_dispatch(worker_id), req, DispatchReply, settings.dispatch_timeout_s
                    )
                except UpstreamTimeout:
                    if expired() or (nc.is_connected and nc.stats["reconnects"] == reconnects):
                        raise
                while not nc.is_connected and not expired():
                    await asyncio.sleep(TICK_S)

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
        )
        task = asyncio.create_task(publish_audit(js, event, f"rejection.scheduler.{uuid.uuid4().hex}"))
        audits.add(task)
        task.add_done_callback(audits.discard)

    async def control(worker_id: str, message: WorkerControl) -> None:
        await nc.publish(subjects.worker_control(worker_id), encode(message))

    async def adapter_record(adapter_id: str, version: int) -> AdapterRecord:
        return await fetch_record(nc, adapter_id, version, settings.dispatch_timeout_s)

    return Ports(dispatch, reply_error, record_rejection, control, adapter_record)


async def _follow_quotas(js: JetStreamContext, quotas: Quotas) -> None:
    """Mirror the registry's tenant quotas (KV ``lf_tenants``); runs until cancelled."""
    while True:
        try:
            watcher = await (await js.key_value(subjects.REGISTRY_TENANTS_BUCKET)).watchall()
            try:
                async for entry in watcher:
                    if entry is not None:
                        quotas.apply(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
            finally:
                await watcher.stop()
        except asyncio.CancelledError:
            raise
        except BucketNotFoundError:
            await asyncio.sleep(1.0)
        except Exception as e:
            log.warning("quota_watch_failed", error=str(e))
            await asyncio.sleep(1.0)


def build(settings: SchedulerSettings, ports: Ports, redis) -> tuple[Dispatcher, Upkeep]:
    guard = RedisGuard()
    prefix = settings.redis_key_prefix
    core = Dispatcher(
        ports=ports,
        admission=Admission(redis, guard, prefix, settings.concurrency_lease_s),
        dispatched=Dispatched(redis, guard, prefix, settings.dedupe_ttl_s),
        heat=Heat(redis, guard, prefix, settings.heat_half_life_s),
        quotas=Quotas.from_settings(settings),
        fleet=Fleet(settings.liveness_timeout_s, settings.capacity_headroom),
        queue=FairQueue(settings.vtc_input_weight, settings.vtc_output_weight, settings.slo_batch_s),
        slo_s={"interactive": settings.slo_interactive_s, "batch": settings.slo_batch_s},
    )
    periods = Periods(
        settings.no_worker_grace_s, ACK_WAIT_S / 3, settings.concurrency_lease_s / 3, settings.heat_decay_interval_s
    )
    prefetcher = Prefetcher(settings.hot_rate_per_worker, settings.cold_rate, settings.max_controls_per_tick)
    return core, Upkeep(core, prefetcher, periods)


async def run(settings: SchedulerSettings) -> None:
    configure_logging("scheduler", settings.log_level)
    setup_tracing("scheduler", settings.trace_exporter)
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"scheduler-{settings.instance_id}")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        redis = connect_redis(settings.redis_url, password=settings.redis_password())
        stack.push_async_callback(redis.aclose)
        core, upkeep = build(settings, _ports(nc, js, settings), redis)

        async def on_worker(msg) -> None:
            try:
                core.fleet.heartbeat(decode(WorkerHeartbeat, msg.data))
                core.pump()
            except LorafleetError as e:
                log.warning("bad_worker_heartbeat", error=e.message)

        async def on_completion(msg) -> None:
            try:
                event = decode(AuditEnvelope, msg.data).body
                if isinstance(event, CompletionAudit):
                    await core.completed(event)
            except LorafleetError as e:
                log.warning("bad_completion_event", error=e.message)

        async def on_cancel(msg) -> None:
            try:
                control = decode(WorkerControl, msg.data)
                if control.action == "cancel":
                    await core.cancel(control.request_id)
            except LorafleetError as e:
                log.warning("bad_cancel", error=e.message)

        await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=on_worker)
        # through JetStream, so that a completion stored while this scheduler was cut off is not missed
        # (it would hold its worker's capacity and its tenant's concurrency slot until swept)
        await follow(js, subjects.AUDIT_STREAM, subjects.AUDIT_COMPLETION_ALL, on_completion)
        await nc.subscribe(subjects.SCHEDULER_CANCEL, cb=on_cancel)
        psub = await js.pull_subscribe(
            subjects.INFER_SUBMIT_ALL,
            durable=CONSUMER,
            stream=subjects.INFER_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_deliver=5),
        )
        # before nc.drain: once a fetch has timed out, nats-py's drain waits its full 30 s on this subscription
        stack.push_async_callback(psub.unsubscribe)
        stop = shutdown_event()

        def status() -> tuple[bool, str]:
            ready = sum(v.beat.ready for v in core.fleet.workers.values())
            detail = f"{ready} workers, {len(core.held)} queued" + (
                "" if core.admission.guard.healthy else ", redis unavailable"
            )
            return nc.is_connected, detail

        async def ticking() -> None:
            while True:
                await asyncio.sleep(TICK_S)
                try:
                    await upkeep.tick(connected=nc.is_connected)
                    QUEUE_DEPTH.labels("scheduler").set(len(core.held))
                except Exception:
                    log.exception("upkeep_failed")

        metrics_port = serve_metrics(settings.metrics_port, settings.metrics_host)
        background = [
            asyncio.create_task(
                publish_heartbeats(
                    nc, "scheduler", settings.instance_id, settings.heartbeat_interval_s, status, metrics_port
                )
            ),
            asyncio.create_task(ticking()),
            asyncio.create_task(_follow_quotas(js, core.quotas)),
        ]
        log.info("scheduler_started")
        while not stop.is_set():
            room = settings.max_inflight - len(core.held)
            if room <= 0:
                await asyncio.sleep(0.05)
                continue
            try:
                # one at a time: nats-py's batch fetch, once its long poll has delivered a first
                # message, waits out the poll for the rest, holding a lone request up to 0.5 s
                msgs = await psub.fetch(batch=1, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                continue
            except Exception as e:
                log.warning("fetch_failed", error=f"{type(e).__name__}: {e}")
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    with continued(msg.headers), _tracer.start_as_current_span("scheduler.admit"):
                        await core.submit(msg.subject, msg.data, msg)
                except Exception:
                    log.exception("submission_crashed", subject=msg.subject)
                    await msg.nak(delay=1)
            await asyncio.sleep(0)  # a dispatch just placed goes out before the next fetch is asked for
        for task in background:
            task.cancel()
        await core.shutdown(settings.dispatch_timeout_s + 1)
        log.info("scheduler_stopped")


def main() -> None:
    event_loop.run(run(load_settings(SchedulerSettings)))
