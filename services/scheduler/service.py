"""Scheduler process: fetch the INFER work queue, admit, queue fairly, place on live workers."""

import asyncio
import contextlib
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from services.scheduler.admission import Admission
from services.scheduler.dedupe import Dispatched
from services.scheduler.dispatcher import Dispatcher, Ports
from services.scheduler.fairness import FairQueue
from services.scheduler.heat import Heat
from services.scheduler.limits import Quotas
from services.scheduler.placement import Fleet
from services.scheduler.ports import bus_ports
from services.scheduler.prefetch import Prefetcher
from services.scheduler.redis_guard import RedisGuard
from services.scheduler.settings import SchedulerSettings
from services.scheduler.shadow import ShadowPolicy
from services.scheduler.shedding import LoadShedder
from services.scheduler.upkeep import Periods, Upkeep
from services.scheduler.vtc import SharedCounters
from services.scheduler.waiting import Intake
from shared import event_loop, subjects
from shared.base_model import resolve_model_dir
from shared.bus import (
    connect,
    decode,
    drain_or_close,
    ensure_streams,
    follow,
    serve,
    settling,
    shutdown_event,
)
from shared.catalog.view import follow_catalog
from shared.config import load_settings
from shared.errors import LorafleetError, QuotaExceeded
from shared.heartbeat import publish_heartbeats
from shared.kv_follow import follow_bucket
from shared.logs import configure_logging
from shared.metrics import QUEUE_DEPTH, SCHEDULER_WORKER_INFLIGHT
from shared.metrics_http import serve_metrics
from shared.prompt_tokens import PromptTokens
from shared.redis_conn import redis_from
from shared.request_ref import RequestRef
from shared.schemas import (
    SLO_CLASSES,
    AuditEnvelope,
    ChargeReply,
    ChargeRequest,
    CompletionAudit,
    WorkerControl,
    WorkerHeartbeat,
)
from shared.telemetry import continued, setup_tracing, tracer
from shared.undecodable import skip

CONSUMER = "scheduler"
# a submission fetched but never acknowledged comes back this long after: one whose fetch reply was
# lost (a NATS node dying under the consumer's leader change) or whose scheduler died; held ones are
# kept with in_progress every ACK_WAIT_S / 3
ACK_WAIT_S = 10
TICK_S = 0.25
FLEET_DISCOVERY_INTERVALS = 1.5  # heartbeat intervals a starting scheduler listens before taking work
FETCH_POLL_S = 0.5  # the long poll of an idle intake
DRAIN_POLL_S = 0.05  # how long a batch fetch may wait once nothing more is stored
INTAKE_BATCH = 256
INTAKE_PER_TENANT = 256
MAX_UNACKED = 1_000_000  # the stream holds fewer (LF_STREAMS__INFER_MAX_MSGS caps at 100M)
ADMIT_POLL_S = 0.05  # how often a blocked admission looks again for room in the queue
INTAKE_FULL = "too many of this tenant's requests are waiting to be admitted"
log = structlog.get_logger("scheduler")
_tracer = tracer("scheduler")


def build(
    settings: SchedulerSettings, ports: Ports, redis, prompt_tokens: PromptTokens | None = None
) -> tuple[Dispatcher, Upkeep]:
    guard = RedisGuard()
    prefix = settings.redis_key_prefix
    core = Dispatcher(
        ports=ports,
        admission=Admission(redis, guard, prefix, settings.concurrency_lease_s),
        dispatched=Dispatched(redis, guard, prefix, settings.dedupe_ttl_s),
        heat=Heat(redis, guard, prefix, settings.heat_half_life_s),
        quotas=Quotas.from_settings(settings),
        fleet=Fleet(settings.liveness_timeout_s, settings.capacity_headroom),
        queue=FairQueue(
            settings.vtc_input_weight, settings.vtc_output_weight, {c: settings.slo_ttft_s.of(c) for c in SLO_CLASSES}
        ),
        shedder=LoadShedder(
            settings.slo_ttft_s, settings.shed_overload, settings.shed_min_samples, settings.shed_margin
        ),
        bounds=settings,
        prompt_tokens=prompt_tokens,
        shadow=ShadowPolicy(settings.shadow_sample, settings.shadow_max_tokens, settings.shadow_max_inflight),
    )
    periods = Periods(
        settings.no_worker_grace_s, ACK_WAIT_S / 3, settings.concurrency_lease_s / 3, settings.heat_decay_interval_s
    )
    prefetcher = Prefetcher(settings.hot_rate_per_worker, settings.cold_rate, settings.max_controls_per_tick)
    counters = SharedCounters(redis, guard, prefix, core.queue, settings.vtc_hand_off_s)
    return core, Upkeep(core, prefetcher, periods, counters)


@dataclass(eq=False)
class Scheduler:
    """The scheduler's wired parts: each bus message or clock tick is one call of a named handler."""

    nc: NATS
    core: Dispatcher
    upkeep: Upkeep
    max_inflight: int
    intake: Intake[Msg] = field(default_factory=lambda: Intake(INTAKE_PER_TENANT))
    _overflow: deque[Msg] = field(default_factory=deque)  # fetched past a full tenant intake: to refuse
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set when the intake gains a message
    _gauged: set[str] = field(default_factory=set)  # workers whose in-flight gauge is exported
    discovered: bool = False  # it has listened to the workers' heartbeats long enough to know the fleet

    async def subscribe(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        """Heartbeats, completions and cancels on their handlers; the work queue's pull subscription."""
        await self.nc.subscribe(subjects.WORKER_HEARTBEAT, cb=self.on_heartbeat)
        # through JetStream, so that a completion stored while this scheduler was cut off is not missed
        # (it would hold its worker's capacity and its tenant's concurrency slot until swept)
        await follow(js, subjects.AUDIT_STREAM, subjects.AUDIT_COMPLETION_ALL, self.on_completion)
        await self.nc.subscribe(subjects.SCHEDULER_CANCEL, cb=self.on_cancel)
        # one scheduler of a replicated set charges each (the quota is global, in Redis)
        await serve(self.nc, subjects.SCHEDULER_CHARGE, ChargeRequest, self.charge, queue=CONSUMER, concurrent=True)
        # the intake holds fetched messages unacknowledged: no cap of the server's (1,000 by default)
        # may stop delivery behind a flood; the stream's own bounds cap them
        config = ConsumerConfig(
            name=CONSUMER,
            durable_name=CONSUMER,
            filter_subject=subjects.INFER_SUBMIT_ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S,
            max_deliver=5,
            max_ack_pending=MAX_UNACKED,
        )
        await settling(js.add_consumer)(subjects.INFER_STREAM, config)  # creates, or updates one made before
        return await js.pull_subscribe_bind(CONSUMER, stream=subjects.INFER_STREAM)

    async def consume(self, psub: JetStreamContext.PullSubscription, stop: asyncio.Event) -> None:
        """Fetch the work queue into the intake and admit from it in tenant turn, until ``stop``."""
        admitting = asyncio.create_task(self.admit_from_intake(stop))
        try:
            while not stop.is_set():
                # a long poll while idle; then, while messages are waiting, batches that return at once
                msgs = await self._fetch(psub, 1, FETCH_POLL_S)
                while msgs:
                    for msg in msgs:
                        await self.on_fetched(msg)
                    msgs = await self._fetch(psub, INTAKE_BATCH, DRAIN_POLL_S)
        finally:
            admitting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await admitting

    async def _fetch(self, psub: JetStreamContext.PullSubscription, batch: int, timeout_s: float) -> list[Msg]:
        try:
            # nats-py answers a batch at once with what is stored, but once it has to wait for a first
            # message it waits out the poll for the rest: batches only while messages are waiting
            return await psub.fetch(batch=batch, timeout=timeout_s)
        except (NatsTimeout, TimeoutError):
            return []
        except Exception as e:
            event_loop.keep_cancel(e)
            log.warning("fetch_failed", error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(0.5)
            return []

    async def on_fetched(self, msg: Msg) -> None:
        """Queue a fetched submission behind its tenant's others, or, its tenant's intake being full,
        for refusal: refused in the admission loop, so that fetching runs on past a flood at once."""
        try:
            tenant = subjects.tenant_of_submit(msg.subject)
        except ValueError:
            tenant = ""  # refused by the admission's parse, in its turn
        if not self.intake.push(tenant, msg, time.monotonic()):
            self._overflow.append(msg)
        self._arrived.set()

    async def admit_from_intake(self, stop: asyncio.Event) -> None:
        """Admit fetched submissions one per tenant per turn, while the scheduler's queue has room
        (past it, a tenant holding less than its share of the queue still gets in); between two
        admissions, refuse one submission of a tenant whose intake was full."""
        while not stop.is_set():
            msg = self.intake.pop(self._admissible())
            if msg is not None:
                await self.on_submission(msg)
            if self._overflow:
                await self._turn_away(self._overflow.popleft())
            if msg is None and not self._overflow:
                self._arrived.clear()
                if not self.intake:  # only an arrival can bring work: no clock wakes an idle scheduler
                    await self._arrived.wait()
                    continue
                with contextlib.suppress(TimeoutError):  # blocked on a full queue: look again for room
                    await asyncio.wait_for(self._arrived.wait(), ADMIT_POLL_S)
                continue
            await asyncio.sleep(0)  # a dispatch just placed goes out before the next admission

    async def _turn_away(self, msg: Msg) -> None:
        try:
            await self.core.turn_away(msg.subject, msg.data, msg, QuotaExceeded(INTAKE_FULL, retry_after_s=1.0))
        except Exception:
            log.exception("turn_away_crashed", subject=msg.subject)

    def _admissible(self) -> Callable[[str], bool]:
        held = self.core.held
        if len(held) < self.max_inflight:
            return lambda _: True
        counts = Counter(item.tenant for item in held.values())
        share = self.max_inflight // max(1, len(counts.keys() | self.intake.tenants()))
        return lambda tenant: counts[tenant] < share

    async def on_submission(self, msg: Msg) -> None:
        try:
            with continued(msg.headers), _tracer.start_as_current_span("scheduler.admit"):
                stored = msg.metadata.timestamp  # the server's time of storing it: what the client has waited
                await self.core.submit(msg.subject, msg.data, msg, msg.metadata.sequence.stream, stored.timestamp())
        except Exception:
            log.exception("submission_crashed", subject=msg.subject)
            await msg.nak(delay=1)

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            self.core.fleet.heartbeat(decode(WorkerHeartbeat, msg.data))
            self.core.pump()
        except LorafleetError as e:
            log.warning("bad_worker_heartbeat", error=e.message)

    async def on_completion(self, msg: Msg) -> None:
        try:
            event = decode(AuditEnvelope, msg.data).body
            if isinstance(event, CompletionAudit):
                await self.core.completed(event)
        except LorafleetError as e:
            skip(subjects.AUDIT_STREAM, msg.subject, e)

    async def on_cancel(self, msg: Msg) -> None:
        try:
            control = decode(WorkerControl, msg.data)
            if control.action == "cancel" and control.request_id is not None and control.tenant_id is not None:
                await self.core.cancel(RequestRef(control.tenant_id, control.request_id))
        except LorafleetError as e:
            log.warning("bad_cancel", error=e.message)

    async def charge(self, charge: ChargeRequest) -> ChargeReply:
        """A request of a tenant's that runs no model, charged to its quota (``QuotaExceeded`` beyond it)."""
        await self.core.admission.charge(charge.tenant_id, self.core.quotas.of(charge.tenant_id))
        return ChargeReply()

    async def ticking(self) -> None:
        """Run the upkeep clock until cancelled."""
        while True:
            await asyncio.sleep(TICK_S)
            await self.on_tick()

    async def on_tick(self) -> None:
        try:
            for msg in self.intake.stale(time.monotonic(), ACK_WAIT_S / 3):
                await msg.in_progress()
            await self.upkeep.tick(connected=self.nc.is_connected)
            self._export_gauges()
        except Exception:
            log.exception("upkeep_failed")

    def _export_gauges(self) -> None:
        """Queue depth, and per worker what placement counts against it: a phantom shows here."""
        QUEUE_DEPTH.labels("scheduler").set(len(self.core.held))
        workers = self.core.fleet.workers
        for gone in self._gauged - workers.keys():
            SCHEDULER_WORKER_INFLIGHT.remove(gone)
        for worker_id, view in workers.items():
            SCHEDULER_WORKER_INFLIGHT.labels(worker_id).set(view.inflight)
        self._gauged = set(workers)

    def status(self) -> tuple[bool, str]:
        ready = sum(v.beat.ready for v in self.core.fleet.workers.values())
        detail = f"{ready} workers, {len(self.core.held)} queued" + (
            "" if self.core.admission.guard.healthy else ", redis unavailable"
        )
        if not self.discovered:
            detail = f"learning the fleet from heartbeats ({detail})"
        return self.nc.is_connected and self.discovered, detail

    async def drain(self, timeout_s: float) -> None:
        """Hand queued requests back to the work queue, let dispatches in progress finish (the stack's step
        after the clocks' cancel, before the subscription, the followers, Redis and NATS close)."""
        for msg in [*self.intake.take_all(), *self._overflow]:  # not admitted: another scheduler decides
            await msg.nak()
        self._overflow.clear()
        await self.core.shutdown(timeout_s)
        log.info("scheduler_stopped")


async def run(settings: SchedulerSettings) -> None:
    configure_logging("scheduler", settings.log_level)
    setup_tracing("scheduler", settings.trace_exporter)
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"scheduler-{settings.instance_id}")
        stack.push_async_callback(drain_or_close, nc)
        js = nc.jetstream()
        await ensure_streams(js)
        redis = redis_from(settings)
        stack.push_async_callback(redis.aclose)
        # a promote, rollback or revoke returns once this view holds it: direct submissions see it at once
        followed = await follow_catalog(
            nc, settings.dispatch_timeout_s, barrier=("scheduler", settings.instance_id), route="nats", routing=True
        )
        stack.callback(followed.stop)
        tokens = None
        if settings.max_prompt_tokens:  # the gateway's count, for direct-NATS submissions
            tokens = await asyncio.to_thread(lambda: PromptTokens.load(resolve_model_dir(settings.model_dir)))
        core, upkeep = build(settings, bus_ports(nc, js, settings, followed.view), redis, tokens)
        scheduler = Scheduler(nc, core, upkeep, settings.max_inflight, Intake(settings.intake_per_tenant))
        psub = await scheduler.subscribe(js)
        # before nc.drain: once a fetch has timed out, nats-py's drain waits its full 30 s on this subscription
        stack.push_async_callback(psub.unsubscribe)
        stop = shutdown_event()
        metrics_port = stack.enter_context(
            serve_metrics(settings.metrics_port, settings.metrics_host, settings.metrics_bearer())
        ).port
        # unwound last in first out: the clocks stop, then the drain, then the subscription, the followers and NATS
        stack.push_async_callback(scheduler.drain, settings.dispatch_timeout_s + 1)
        background = [
            asyncio.create_task(
                publish_heartbeats(
                    nc, "scheduler", settings.instance_id, settings.heartbeat_interval_s, scheduler.status, metrics_port
                )
            ),
            asyncio.create_task(scheduler.ticking()),
            asyncio.create_task(upkeep.counters.run()),
            asyncio.create_task(  # the registry's tenant quotas (KV ``lf_tenants``)
                follow_bucket(
                    nc,
                    subjects.REGISTRY_TENANTS_BUCKET,
                    lambda key, value, _: core.quotas.apply(key, value),
                    lambda: log.info("quotas_loaded"),
                )
            ),
        ]
        stack.push_async_callback(event_loop.cancel_all, background)
        # a scheduler that took work at once would place and shed it on the first worker it heard of:
        # every worker heartbeats within an interval, so it listens that long (and half again) first
        await asyncio.sleep(FLEET_DISCOVERY_INTERVALS * settings.heartbeat_interval_s)
        scheduler.discovered = True
        log.info("scheduler_started", workers=len(core.fleet.workers))
        await scheduler.consume(psub, stop)


def main() -> None:
    event_loop.run(run(load_settings(SchedulerSettings, sys.argv[1:])))
