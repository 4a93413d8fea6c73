"""Worker process: load the base model, run the engine and the adapter cache, answer dispatches."""

import asyncio
import contextlib
import sys
from dataclasses import dataclass
from functools import partial
from typing import cast

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from redis.asyncio import Redis
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
DRAIN_S = 10  # how long a stopping worker lets its requests in progress run on

log = structlog.get_logger("worker")
_tracer = tracer("worker")


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


async def emit(nc: NATS, reply_to: str, message: ReplyMessage) -> None:
    """One message of a request's reply stream, to the client's inbox."""
    await nc.publish(reply_to, encode(ReplyEnvelope(body=message)))


async def audit(js: JetStreamContext, worker_id: str, event: CompletionAudit | RejectionAudit) -> None:
    """A finished or refused request's record, on the AUDIT stream."""
    await publish_audit(js, event, f"{event.kind}.{worker_id}.{event.tenant_id}.{event.request_id}")


@dataclass(eq=False)
class Worker:
    """The worker's wired parts: each bus message or clock tick is one call of a named handler."""

    nc: NATS
    settings: WorkerSettings
    served: engines.Served
    server: RequestServer
    catalog: CatalogView
    pins: PinFollower

    @classmethod
    def wire(cls, nc: NATS, settings: WorkerSettings, served: engines.Served, catalog: CatalogView) -> "Worker":
        """The request server over ``served``: its replies to the clients' inboxes, its records to AUDIT."""
        server = RequestServer(
            served.engine,
            served.prompts,
            settings.worker_id,
            served.model_name,
            partial(emit, nc),
            partial(audit, nc.jetstream(), settings.worker_id),
            settings.max_waiting,
            served.cache,
            catalog,
            settings.adapter_metric_labels,
            served.rank_classes,
            settings.slo_window,
            catalog.owner,
        )
        pins = PinFollower(settings.worker_id, served.cache, lambda: catalog.catalog)
        return cls(nc, settings, served, server, catalog, pins)

    async def subscribe(self, js: JetStreamContext) -> None:
        """Adapter events (through JetStream), this worker's dispatches and controls."""
        await follow(js, subjects.ADAPTER_EVENTS_STREAM, subjects.ADAPTER_EVENTS_ALL, self.on_event)
        await self.nc.subscribe(subjects.worker_dispatch(self.settings.worker_id), cb=self.on_dispatch)
        await self.nc.subscribe(subjects.worker_control(self.settings.worker_id), cb=self.on_control)

    async def on_dispatch(self, msg: Msg) -> None:
        worker_id = self.settings.worker_id
        try:
            request = decode(InferRequest, msg.data)
            with (
                continued(msg.headers),
                _tracer.start_as_current_span("worker.accept", attributes={"lf.request_id": request.request_id}),
            ):
                await self.server.accept(request)
            reply = DispatchReply(accepted=True, worker_id=worker_id)
        except LorafleetError as e:
            log.info("dispatch_refused", error=e.message, code=e.code)
            reply = DispatchReply(accepted=False, worker_id=worker_id, error=e.to_body())
        if msg.reply:
            await self.nc.publish(msg.reply, encode(reply))

    async def on_control(self, msg: Msg) -> None:
        try:
            done = _control(decode(WorkerControl, msg.data), self.server, self.served.cache, self.catalog.catalog)
        except LorafleetError as e:
            log.warning("bad_control_message", error=e.message)
            if msg.reply:
                await reply_error(self.nc, msg.reply, e)
            return
        log.debug("worker_control", action=done.action, outcome=done.outcome)
        if msg.reply:
            await self.nc.publish(msg.reply, encode(done))

    async def on_event(self, msg: Msg) -> None:
        try:
            on_adapter_event(decode(AdapterEvent, msg.data), self.served.cache, self.server)
        except LorafleetError as e:
            log.warning("bad_adapter_event", error=e.message)
            return
        self.pins.reconcile()  # a promotion or rollback moves a pin of the served version

    async def beating(self) -> None:
        """Export the engine's and the cache's figures and publish a worker heartbeat, every interval."""
        served, settings = self.served, self.settings
        counted = (0, 0)  # prefix-cache totals already added to the counters
        while True:
            stats, residency = self.server.engine.stats(), served.cache.stats()
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
            if self.nc.is_connected:
                with contextlib.suppress(Exception):
                    await self.nc.publish(subjects.WORKER_HEARTBEAT, encode(beat))
            await asyncio.sleep(settings.heartbeat_interval_s)

    async def following_heat(self, redis: Redis) -> None:
        """Feed the fleet's adapter heat (Redis, written by the scheduler) to the eviction policy."""
        rates = HeatKeys.under(self.settings.redis_key_prefix).rates
        while True:
            try:
                scores = await redis.zrange(rates, 0, -1, withscores=True)
                # redis-py types zrange for every option at once; withscores and decoded responses
                # give (member, score) pairs
                self.served.cache.update_heat(dict(cast(list[tuple[str, float]], scores)))
            except (RedisError, OSError) as e:
                event_loop.keep_cancel(e)
                metrics.REDIS_FALLBACKS.labels("heat_read").inc()
            await asyncio.sleep(self.settings.heat_refresh_s)

    async def keeping_pins(self) -> None:
        """Apply the pins again every interval: a served version moved, or a pinned load failed."""
        while True:
            await asyncio.sleep(self.settings.pin_refresh_s)
            self.pins.reconcile()

    async def drain(self, beats: asyncio.Task) -> None:
        """Give the requests in progress up to ``DRAIN_S`` to finish, then stop heartbeating (the stack's
        step after the clocks' cancel, before the followers, the engine and NATS close)."""
        if self.server.tasks:
            await asyncio.wait(list(self.server.tasks.values()), timeout=DRAIN_S)
        await event_loop.cancel_all([beats])
        log.info("worker_stopped")


async def run(settings: WorkerSettings) -> None:
    configure_logging("worker", settings.log_level)
    setup_tracing("worker", settings.trace_exporter)
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(
            settings.nats_url, f"worker-{settings.worker_id}", inbox_prefix=subjects.worker_inbox(settings.worker_id)
        )
        stack.push_async_callback(drain_or_close, nc)
        js = nc.jetstream()
        await ensure_streams(js)
        stop = shutdown_event()
        metrics_port = stack.enter_context(
            serve_metrics(settings.metrics_port, settings.metrics_host, settings.metrics_bearer())
        ).port
        phases = StartPhase(settings.worker_id)
        beats = asyncio.create_task(  # from the start: the gateway's /readyz shows how far loading has come
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
        stack.push_async_callback(event_loop.cancel_all, [beats])  # a failed start; a drain stops them earlier
        build = engines.vllm if settings.worker_engine == "vllm" else engines.builtin
        catalog = CatalogView(ask_registry(nc, REGISTRY_TIMEOUT_S), route="dispatch")
        served = await build(nc, catalog, settings, stack, phases)  # the engine and the cache enter the stack
        phases.enter("warming", "engine, catalog mirror, subscriptions")
        followed = await follow_catalog(
            nc, REGISTRY_TIMEOUT_S, barrier=("worker", settings.worker_id), signers=True, view=catalog
        )
        stack.callback(followed.stop)
        redis = redis_from(settings)
        stack.push_async_callback(redis.aclose)
        worker = Worker.wire(nc, settings, served, catalog)
        await worker.subscribe(js)
        served.cache.start()
        # unwound last in first out: the clocks stop, then the drain, then the followers, the engine and NATS
        stack.push_async_callback(worker.drain, beats)
        background = [
            asyncio.create_task(worker.beating()),
            asyncio.create_task(worker.following_heat(redis)),
            asyncio.create_task(
                follow_bucket(nc, subjects.REGISTRY_PINS_BUCKET, worker.pins.apply, lambda: log.info("pins_loaded"))
            ),
            asyncio.create_task(worker.keeping_pins()),
        ]
        stack.push_async_callback(event_loop.cancel_all, background)
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


def main() -> None:
    event_loop.run(run(load_settings(WorkerSettings, sys.argv[1:])))
