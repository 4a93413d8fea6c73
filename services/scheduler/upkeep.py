"""What the scheduler does on a clock: fail over lost workers, drop expired or unplaceable queued
requests, keep queued messages and concurrency leases alive, and act on adapter heat."""

import time
from dataclasses import dataclass

import structlog

from services.scheduler.dispatcher import Dispatcher
from services.scheduler.prefetch import Prefetcher
from services.scheduler.submission import past_accept_deadline
from services.scheduler.vtc import SharedCounters
from shared import metrics
from shared.errors import NoWorkerAvailable, WorkerLost

log = structlog.get_logger("scheduler")


@dataclass(slots=True)
class Periods:
    no_worker_grace_s: float
    keep_alive_s: float
    lease_renew_s: float
    heat_s: float


@dataclass
class Upkeep:
    core: Dispatcher
    prefetcher: Prefetcher
    periods: Periods
    counters: SharedCounters  # the fair queue's counters, shared with the other schedulers on their own clock
    _last_keep_alive: float = 0.0
    _last_renew: float = 0.0
    _last_heat: float = 0.0
    _cut_off: bool = False

    async def tick(self, now: float | None = None, connected: bool = True) -> None:
        """``connected``: whether this scheduler hears the bus; while it does not, no worker is judged lost."""
        now = time.monotonic() if now is None else now
        if not connected:
            self._cut_off = True
        elif self._cut_off:
            self._cut_off = False
            self.core.fleet.resume(now)
        else:
            await self.fail_over(now)
        await self.sweep_queue(now)
        await self.sweep_inflight()
        if now - self._last_keep_alive >= self.periods.keep_alive_s:
            self._last_keep_alive = now
            for item in list(self.core.held.values()):
                await item.handle.in_progress()
        if now - self._last_renew >= self.periods.lease_renew_s:
            self._last_renew = now
            grants = [i.grant for i in self.core.held.values()] + [e.grant for e in self.core.inflight.values()]
            await self.core.admission.renew(grants)
        if now - self._last_heat >= self.periods.heat_s:
            self._last_heat = now
            await self.act_on_heat()
        self.core.pump()

    async def fail_over(self, now: float) -> None:
        """A worker silent past the timeout is gone: the requests it accepted end with ``worker_lost``
        (they may have streamed tokens already, so rerunning them elsewhere could duplicate output);
        requests still queued here simply go to the workers that remain."""
        core = self.core
        for worker_id in core.fleet.expire(now):
            lost = [ref for ref, e in core.inflight.items() if e.worker_id == worker_id]
            log.warning("worker_lost", worker_id=worker_id, requests=len(lost))
            metrics.WORKERS_LOST.labels("with_requests" if lost else "idle").inc()
            for ref in lost:
                entry = core.inflight.pop(ref, None)
                if entry is None:  # its completion arrived while an earlier error reply was being sent
                    continue
                rid = ref.request_id
                error = WorkerLost(f"worker {worker_id} stopped while serving request {rid}; retry it")
                if entry.request.shadow_of is None:  # a shadow run has no client to answer
                    await core.ports.reply_error(entry.request.reply_to, rid, error)
                    await core.ports.record_rejection(ref.tenant, rid, error)
                await core.admission.release(entry.grant, None)

    async def sweep_queue(self, now: float) -> None:
        core, wall = self.core, time.time()
        for item in list(core.queue):
            request = item.request
            late = past_accept_deadline(request, wall)
            if late is not None:  # answered and audited as at admission: never dropped silently
                await core.drop_queued(item, late)
            elif now - item.enqueued > self.periods.no_worker_grace_s and not core.fleet.serves(request):
                what = (
                    request.base_model
                    if request.adapter is None
                    else f"{request.adapter.adapter_id} on {request.base_model}"
                )
                await core.drop_queued(item, NoWorkerAvailable(f"no live worker serves {what}"))

    async def sweep_inflight(self) -> None:
        """A request past its own timeout, counted from its admission here (``created_at`` as the
        scheduler stamped it, never the client's), with no completion seen (an audit event lost)
        stops holding its tenant's concurrency slot."""
        core, wall = self.core, time.time()
        for ref, entry in list(core.inflight.items()):
            expired = wall > entry.request.created_at + entry.request.timeout_s + 30
            if expired and core.inflight.pop(ref, None) is not None:  # unless it ended meanwhile
                core.fleet.ended(entry.worker_id, ref)
                log.info("inflight_expired", request_id=ref.request_id, tenant=ref.tenant, worker_id=entry.worker_id)
                await core.admission.release(entry.grant, None)

    async def act_on_heat(self) -> None:
        rates = await self.core.heat.decay()
        for worker_id, control in self.prefetcher.plan(rates, self.core.fleet):
            metrics.SCHEDULER_CONTROLS.labels(control.action).inc()
            await self.core.ports.control(worker_id, control)
