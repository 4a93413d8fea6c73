"""Worker process: load the base model, run the engine and the adapter cache, answer dispatches."""

import asyncio
import contextlib
import sys
from typing import cast

import structlog
from nats.aio.client import Client as NATS
from redis.exceptions import RedisError

from services.worker import engines
from services.worker.adapter_cache.hierarchy import CacheHierarchy
from services.worker.adapter_events import on_adapter_event
from services.worker.pin_follower import PinFollower
from services.worker.serving import RequestServer
from services.worker.settings import WorkerSettings
from services.worker.start_phase import StartPhase
from shared import event_loop, metrics, subjects
from shared.adapter_keys import HeatKeys, adapter_key
from shared.audit_publish import publish_audit
from shared.bus import (
    connect,
    decode,
    drain_or_close,
    encode,
    ensure_streams,
    follow,
    reply_error,
    shutdown_event,
)
from shared.catalog.records import Catalog
from shared.catalog.view import CatalogView, ask_registry, follow_catalog
from shared.config import load_settings
from shared.errors import InvalidMessage, LorafleetError
from shared.heartbeat import publish_heartbeats
from shared.kv_follow import follow_bucket
from shared.logs import configure_logging
from shared.metrics_http import serve_metrics
from shared.redis_conn import redis_from
from shared.request_ref import RequestRef
from shared.schemas import (
    AdapterEvent,
    CompletionAudit,
    ControlOutcome,
    DispatchReply,
    InferRequest,
    RejectionAudit,
    ReplyEnvelope,
    ReplyMessage,
    WorkerControl,
    WorkerControlReply,
    WorkerHeartbeat,
)
from shared.telemetry import continued, setup_tracing, tracer

REGISTRY_TIMEOUT_S = 5.0  # a dispatch's grant check that the worker's mirror cannot settle asks the registry

log = structlog.get_logger("worker")


async def _worker_heartbeats(nc: NATS, server: RequestServer, served: engines.Served, settings: WorkerSettings) -> None:
    counted = (0, 0)  # prefix-cache totals already added to the counters
    while True:
        stats, residency = server.engine.stats(), served.cache.stats()
        metrics.PREFIX_QUERIED_TOKENS.inc(stats.prefix_queried_tokens - counted[0])
        metrics.PREFIX_HIT_TOKENS.inc(stats.prefix_hit_tokens - counted[1])
        counted = (stats.prefix_queried_tokens, stats.prefix_hit_tokens)
        metrics.RUNNING.set(stats.running)
        metrics.QUEUE_DEPTH.labels("worker").set(stats.waiting)
        metrics.KV_USAGE.set(1 - stats.kv_blocks_free / max(1, stats.kv_blocks_total))
        beat = WorkerHeartbeat(
            worker_id=settings.worker_id,
            base_model=served.model_name,
            ready=True,
            running=stats.running,
            waiting=stats.waiting,
            max_running=served.max_running,
            kv_blocks_free=stats.kv_blocks_free,
            kv_blocks_total=stats.kv_blocks_total,
            resident_adapters=residency.gpu_adapters,
            cpu_adapters=residency.cpu_adapters,
            slots={str(rank): list(used) for rank, used in residency.slots.items()},
            pinned=residency.pinned,
            pins_refused=residency.pins_refused,
            cache_hit_ratio=residency.hit_ratio,
            load_ms_mean=residency.load_ms_mean,
            capability=served.capability,
            rank_pool=list(served.rank_pool),
        )
        if nc.is_connected:
            with contextlib.suppress(Exception):
                await nc.publish(subjects.WORKER_HEARTBEAT, encode(beat))
        await asyncio.sleep(settings.heartbeat_interval_s)


async def _follow_heat(settings: WorkerSettings, cache: CacheHierarchy) -> None:
    """Feed the fleet's adapter heat (Redis, written by the scheduler) to the eviction policy."""
    redis = redis_from(settings)
    try:
        while True:
            try:
                scores = await redis.zrange(HeatKeys.under(settings.redis_key_prefix).rates, 0, -1, withscores=True)
                # redis-py types zrange for every option at once; withscores and decoded responses
                # give (member, score) pairs
                cache.update_heat(dict(cast(list[tuple[str, float]], scores)))
            except (RedisError, OSError):
                metrics.REDIS_FALLBACKS.labels("heat_read").inc()
            await asyncio.sleep(settings.heat_refresh_s)
    finally:
        await redis.aclose()


async def _keep_pins(pins: PinFollower, refresh_s: float) -> None:
    """Apply the pins again every ``refresh_s``: a served version moved, or a pinned load failed."""
    while True:
        await asyncio.sleep(refresh_s)
        pins.reconcile()


def _control(
    control: WorkerControl, server: RequestServer, cache: CacheHierarchy, catalog: Catalog
) -> WorkerControlReply:
    """Apply one control message; what it did (sent back when the message asked for an answer)."""
    outcome: ControlOutcome = "done"
    if control.action == "cancel":
        assert control.request_id and control.tenant_id, "WorkerControl validates that a cancel names its request"
        if not server.cancel(RequestRef(control.tenant_id, control.request_id)):
            outcome = "not_running"
        return WorkerControlReply(action=control.action, outcome=outcome)
    if not control.adapter_id or control.adapter_version is None:
        raise InvalidMessage(f"{control.action} needs adapter_id and adapter_version")
    key = adapter_key(control.adapter_id, control.adapter_version)
    if control.action == "prefetch":
        if not cache.prefetch(key):
            outcome = "resident_or_loading"
    elif control.action == "evict":
        outcome = cache.evict(key)
    elif control.action == "pin":
        record = catalog.get(control.adapter_id, control.adapter_version)
        if not cache.pin(key, record.rank if record else None, record.tenant_id if record else None):
            raise InvalidMessage(f"pin of {key} refused: its rank class is full of pins")
    elif control.action == "unpin":
        cache.unpin(key)
    return WorkerControlReply(action=control.action, outcome=outcome)


async def run(settings: WorkerSettings) -> None:
    configure_logging("worker", settings.log_level)
    setup_tracing("worker", settings.trace_exporter)
    span_tracer = tracer("worker")
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(
            settings.nats_url, f"worker-{settings.worker_id}", inbox_prefix=subjects.worker_inbox(settings.worker_id)
        )
        stack.push_async_callback(drain_or_close, nc)
        js = nc.jetstream()
        await ensure_streams(js)
        stop = shutdown_event()
        metrics_port = serve_metrics(settings.metrics_port, settings.metrics_host, settings.metrics_bearer())
        phases = StartPhase(settings.worker_id)
        beats = asyncio.create_task(
            publish_heartbeats(
                nc,
                "worker",
                settings.worker_id,
                settings.heartbeat_interval_s,
                phases.status,
                metrics_port,
                phase=phases.current,
            )
        )
        build = engines.vllm if settings.worker_engine == "vllm" else engines.builtin
        catalog = CatalogView(ask_registry(nc, REGISTRY_TIMEOUT_S), route="dispatch")
        served = await build(nc, catalog, settings, stack, phases)
        phases.enter("warming", "engine, catalog mirror, subscriptions")
        cache = served.cache

        async def emit(reply_to: str, message: ReplyMessage) -> None:
            await nc.publish(reply_to, encode(ReplyEnvelope(body=message)))

        async def audit(event: CompletionAudit | RejectionAudit) -> None:
            await publish_audit(js, event, f"{event.kind}.{settings.worker_id}.{event.tenant_id}.{event.request_id}")

        followed = await follow_catalog(
            nc, REGISTRY_TIMEOUT_S, barrier=("worker", settings.worker_id), signers=True, view=catalog
        )
        stack.callback(followed.stop)
        server = RequestServer(
            served.engine,
            served.prompts,
            settings.worker_id,
            served.model_name,
            emit,
            audit,
            settings.max_waiting,
            cache,
            catalog,
            settings.adapter_metric_labels,
            served.rank_classes,
            settings.slo_window,
            catalog.owner,
        )

        async def on_dispatch(msg) -> None:
            try:
                request = decode(InferRequest, msg.data)
                with (
                    continued(msg.headers),
                    span_tracer.start_as_current_span(
                        "worker.accept", attributes={"lf.request_id": request.request_id}
                    ),
                ):
                    await server.accept(request)
                reply = DispatchReply(accepted=True, worker_id=settings.worker_id)
            except LorafleetError as e:
                log.info("dispatch_refused", error=e.message, code=e.code)
                reply = DispatchReply(accepted=False, worker_id=settings.worker_id, error=e.to_body())
            if msg.reply:
                await nc.publish(msg.reply, encode(reply))

        async def on_control(msg) -> None:
            try:
                done = _control(decode(WorkerControl, msg.data), server, cache, catalog.catalog)
            except LorafleetError as e:
                log.warning("bad_control_message", error=e.message)
                if msg.reply:
                    await reply_error(nc, msg.reply, e)
                return
            log.debug("worker_control", action=done.action, outcome=done.outcome)
            if msg.reply:
                await nc.publish(msg.reply, encode(done))

        async def on_event(msg) -> None:
            try:
                on_adapter_event(decode(AdapterEvent, msg.data), cache, server)
            except LorafleetError as e:
                log.warning("bad_adapter_event", error=e.message)
                return
            pins.reconcile()  # a promotion or rollback moves a pin of the served version

        pins = PinFollower(settings.worker_id, cache, lambda: catalog.catalog)
        await follow(js, subjects.ADAPTER_EVENTS_STREAM, subjects.ADAPTER_EVENTS_ALL, on_event)
        await nc.subscribe(subjects.worker_dispatch(settings.worker_id), cb=on_dispatch)
        await nc.subscribe(subjects.worker_control(settings.worker_id), cb=on_control)
        cache.start()
        background = [
            asyncio.create_task(_worker_heartbeats(nc, server, served, settings)),
            asyncio.create_task(_follow_heat(settings, cache)),
            asyncio.create_task(
                follow_bucket(nc, subjects.REGISTRY_PINS_BUCKET, pins.apply, lambda: log.info("pins_loaded"))
            ),
            asyncio.create_task(_keep_pins(pins, settings.pin_refresh_s)),
        ]
        phases.enter("ready")
        log.info(
            "worker_ready",
            worker_id=settings.worker_id,
            model=served.model_name,
            engine=settings.worker_engine,
            rank_pool=list(served.rank_pool),
        )
        await stop.wait()
        phases.enter("draining")
        for task in background:
            task.cancel()
        if server.tasks:
            await asyncio.wait(list(server.tasks.values()), timeout=10)
        beats.cancel()
        log.info("worker_stopped")


def main() -> None:
    event_loop.run(run(load_settings(WorkerSettings, sys.argv[1:])))
