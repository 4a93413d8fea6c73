"""The scheduler's core, free of NATS: admit submissions, queue them fairly, dispatch them to
workers with room, and account for their end. Transport acts come in through ``Ports`` and
each submission's ``Handle`` (a JetStream message: ack once a worker accepted, term if refused)."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from services.scheduler.admission import Admission, AlreadyDispatched, Grant, token_cost
from services.scheduler.dedupe import Dispatched
from services.scheduler.fairness import FairQueue
from services.scheduler.heat import Heat
from services.scheduler.held import Handle, Inflight, Queued, ShadowHandle
from services.scheduler.limits import Quotas
from services.scheduler.placement import Fleet, adapter_key_of
from services.scheduler.shadow import ShadowPolicy, mark, shadow_of
from services.scheduler.shedding import LoadShedder
from services.scheduler.submission import parse_submission, past_accept_deadline, refusal_target, slo_class_of
from shared import metrics, subjects
from shared.catalog.grants import IsolationAttempt
from shared.catalog.view import CatalogView
from shared.config import RequestBounds
from shared.errors import (
    LorafleetError,
    NoResponders,
    Overloaded,
    QuotaExceeded,
    RequestIdInUse,
    UpstreamTimeout,
    from_body,
)
from shared.prompt_tokens import PromptTokens
from shared.request_bounds import check_submission
from shared.request_ref import RequestRef
from shared.schemas import (
    CompletionAudit,
    DispatchReply,
    InferRequest,
    SloClass,
    TenantQuota,
    WorkerControl,
)
from shared.undecodable import skip

log = structlog.get_logger("scheduler")


@dataclass(slots=True)
class Ports:
    dispatch: Callable[[str, InferRequest, dict[str, str] | None], Awaitable[DispatchReply]]
    reply_error: Callable[[str, str, LorafleetError], Awaitable[None]]
    record_rejection: Callable[[str, str, LorafleetError], Awaitable[None]]
    control: Callable[[str, WorkerControl], Awaitable[None]]
    # what submissions are granted by; without a registry behind it, every adapter request is refused
    catalog: CatalogView = field(default_factory=CatalogView)


@dataclass
class Dispatcher:
    ports: Ports
    admission: Admission
    dispatched: Dispatched
    heat: Heat
    quotas: Quotas
    fleet: Fleet
    queue: FairQueue[Queued]
    shedder: LoadShedder
    bounds: RequestBounds
    prompt_tokens: PromptTokens | None = None  # None: prompts bounded in characters only
    shadow: ShadowPolicy = field(default_factory=lambda: ShadowPolicy(0.0, 1, 0))  # default: none
    # request ids are per tenant: every in-flight map is keyed by (tenant, request id)
    held: dict[RequestRef, Queued] = field(default_factory=dict)  # queued or being dispatched
    inflight: dict[RequestRef, Inflight] = field(default_factory=dict)  # accepted by a worker, not yet ended
    tasks: set[asyncio.Task] = field(default_factory=set)
    # request -> worker id -> its run's completion, seen while the request was still held here
    early: dict[RequestRef, dict[str, CompletionAudit]] = field(default_factory=dict)

    async def submit(
        self, subject: str, data: bytes, handle: Handle, seq: int | None = None, stored_at: float | None = None
    ) -> None:
        """A submission from the work queue (``seq``: its stream sequence, which tells a redelivery
        from a new submission reusing a request id; ``stored_at``: epoch seconds the stream stored
        it): refuse, drop, or admit and queue it."""
        try:
            request, preview = parse_submission(subject, data)
        except LorafleetError as e:
            await self.turn_away(subject, data, handle, e)
            return
        if await self._settled_as_known(request, handle, seq):
            return
        quota = self.quotas.of(request.tenant_id)
        try:
            granted, slo_class = await self._vetted(request, preview, quota, len(data), stored_at)
        except LorafleetError as e:
            if await self.dispatched.seen(request.tenant_id, request.request_id):  # served: not refused under it
                await self._served_before(request, handle, seq)
                return
            await self._refuse(request, e)
            await handle.term()
            return
        grant = await self._admitted(granted, quota, handle, seq)
        if grant is not None:
            stamped = mark(self._stamped(granted, quota, preview, slo_class), self.ports.catalog.catalog, self.shadow)
            self._enqueue(Queued(stamped, handle, grant, seq))

    async def _settled_as_known(self, request: InferRequest, handle: Handle, seq: int | None) -> bool:
        """Settle, without admitting it again, a submission this scheduler knows or must not run: a new
        one under an id in use (refused), a redelivery of one held or in flight (kept, acknowledged), one
        past its accept deadline (refused), one served before. False: it is new here."""
        rid, tenant, ref = request.request_id, request.tenant_id, RequestRef.of(request)
        taken = self.held.get(ref) or self.inflight.get(ref)
        if seq is not None and taken is not None and taken.seq != seq:
            # a new submission of this tenant's under an id in use: refused, and never answered on the
            # first one's inbox (another tenant's request under the same id is another request)
            reply_to = None if request.reply_to == taken.request.reply_to else request.reply_to
            await self._refuse_raw((tenant, rid, reply_to), RequestIdInUse(f"request id {rid} is in use"))
            await handle.term()
            return True
        if ref in self.held:  # redelivered while we hold it: keep the newest delivery to acknowledge
            self.held[ref].handle = handle
            return True
        late = past_accept_deadline(request, time.time())
        if late is not None:  # the client said it stops waiting then: refused (answered and audited), never run late
            await self._refuse(request, late)
            await handle.term()
            return True
        if ref in self.inflight:
            await handle.ack()
            return True
        if self.dispatched.seen_here(tenant, rid):
            await self._served_before(request, handle, seq)
            return True
        return False

    async def _vetted(
        self, request: InferRequest, preview: bool, quota: TenantQuota, size: int, stored_at: float | None
    ) -> tuple[InferRequest, SloClass]:
        """The request as its grant resolved it, and its SLO class; a typed error when its tier, its
        bounds, its adapter grant or the fleet's load refuses it."""
        slo_class = slo_class_of(request, quota)
        await check_submission(request, size, self.bounds, self.prompt_tokens)
        granted = await self.ports.catalog.grant(request, preview, quota.slo_tier or "standard")
        self._check_load(granted, slo_class, stored_at)
        return granted, slo_class

    def _check_load(self, request: InferRequest, slo_class: SloClass, stored_at: float | None) -> None:
        """Overloaded when the shedder would not meet the class's target for one more request."""
        now = time.monotonic()
        free = self.fleet.free_sequences(request)
        waited = max(0.0, time.time() - stored_at) if stored_at is not None else 0.0
        ahead = self.queue.ahead_of(slo_class, now)
        patience = request.accept_deadline - time.time() if request.accept_deadline is not None else None
        try:
            self.shedder.check(slo_class, ahead, free, len(self.inflight), now, waited, patience)
        except Overloaded:
            loads = {w: (v.load, v.beat.max_running) for w, v in self.fleet.workers.items()}
            log.info("request_shed", request_id=request.request_id, tenant=request.tenant_id, slo_class=slo_class,
                     ahead=ahead, free=free, waited_s=round(waited, 3), worker_loads=loads)  # fmt: skip
            raise

    async def _admitted(
        self, request: InferRequest, quota: TenantQuota, handle: Handle, seq: int | None
    ) -> Grant | None:
        """The request's quota grant; None when it was settled instead (dispatched before, or over quota)."""
        try:
            return await self.admission.admit(
                request, quota, self.dispatched.key(request.tenant_id, request.request_id)
            )
        except AlreadyDispatched:  # another scheduler (or this one before a restart) dispatched it
            await self._served_before(request, handle, seq)
        except QuotaExceeded as e:
            await self._refuse(request, e)
            await handle.term()
        return None

    def _stamped(self, request: InferRequest, quota: TenantQuota, preview: bool, slo_class: SloClass) -> InferRequest:
        """The request with the fields only the scheduler sets. These are never the client's (a
        direct-NATS client writes them): a client's created_at would let the inflight sweep free the
        slot of a request still running, its tenant_gpu_slots or tenant_slot_enforce would lift the
        quota the worker's cache enforces at eviction time, its preview would let the worker serve a
        staging version, and its TTFT target would be measured against a bound of its own choosing."""
        return request.model_copy(
            update={
                "created_at": time.time(),
                "tenant_gpu_slots": quota.max_gpu_adapter_slots or None,  # the quota's 0 = no limit = None
                "tenant_slot_enforce": quota.enforce,
                "preview": preview,
                "priority": slo_class,
                "ttft_target_s": self.shedder.targets.of(slo_class),
                "compare_tokens": None,
                "shadow_of": None,
            }
        )

    def _enqueue(self, item: Queued) -> None:
        self.shedder.admitted(item.priority, time.monotonic())
        self.held[item.ref] = item
        self.queue.push(item)
        self.pump()

    async def turn_away(self, subject: str, data: bytes, handle: Handle, error: LorafleetError) -> None:
        """Refuse a submission unread (unparsable, or its tenant has too many waiting): answer and audit
        ``error`` where the body names an inbox and tenant, and terminate it. A body that is no
        submission at all is dropped, counted, and neither answered nor audited."""
        target = refusal_target(subject, data)
        if target is None:
            skip(subjects.INFER_STREAM, subject, error)
        else:
            log.warning("submission_refused", subject=subject, error=error.message)
            await self._refuse_raw(target, error)
        await handle.term()

    async def _served_before(self, request: InferRequest, handle: Handle, seq: int | None) -> None:
        """A worker took this tenant's request id before: a redelivery of that submission is
        acknowledged (it runs once), a new submission under the id is refused."""
        if await self.dispatched.same_submission(request.tenant_id, request.request_id, seq):
            await handle.ack()
            return
        await self._refuse(request, RequestIdInUse(f"request id {request.request_id} is in use"))
        await handle.term()

    def pump(self) -> None:
        """Start a dispatch for every queued request a worker has room for, in fair order."""
        now = time.monotonic()
        # whether any worker has room, per placement signature, this round: the fair queue asks it of
        # every queued request, and a full placement per request would cost queue x workers a dispatch
        fits: dict[tuple, bool] = {}

        def placeable(item: Queued) -> bool:
            signature = self.fleet.signature(item.request)
            ok = fits.get(signature)
            if ok is None:
                ok = fits[signature] = self.fleet.choose(item.request, now=now) is not None
            return ok

        while True:
            fits.clear()
            item = self.queue.pop(now, placeable)
            if item is None:
                return
            worker = self.fleet.choose(item.request, now=now)  # the best one for this request itself
            if worker is None:  # cannot be: its signature found room this round
                self.queue.push(item, front=True)
                return
            self._note_spill(item.request, worker)
            self.fleet.sent(worker, item.request, now)
            task = asyncio.create_task(self._dispatch_logged(item, worker))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _note_spill(self, request: InferRequest, worker_id: str) -> None:
        """Count and log a pooled adapter placed outside its rank pool (every pool worker saturated)."""
        rank_class = self.fleet.spilled_from(request, worker_id)
        if rank_class is None or request.adapter is None:
            return
        metrics.RANK_SPILLS.labels(str(rank_class)).inc()
        log.info(
            "rank_spill",
            request_id=request.request_id,
            tenant=request.tenant_id,
            adapter=adapter_key_of(request),
            rank=request.adapter.rank,
            rank_class=rank_class,
            worker_id=worker_id,
        )

    async def _dispatch_logged(self, item: Queued, worker_id: str) -> None:
        try:
            await self._dispatch(item, worker_id)
        except Exception:  # a failed ack or publish: JetStream redelivers and dedupe settles it
            log.exception("dispatch_crashed", request_id=item.request_id, worker_id=worker_id)

    async def _dispatch(self, item: Queued, worker_id: str) -> None:
        request, ref = item.request, item.ref
        shadow = request.shadow_of is not None  # the scheduler's own: no submission to dedupe
        if not shadow and not await self.dispatched.mark(request.tenant_id, request.request_id, item.seq):
            # claimed before: its submission was redelivered here after another scheduler (or this one
            # before a restart) dispatched it; it runs once
            self.fleet.refused(worker_id, ref, back_off=False)
            await self._forget(item)
            await self._served_before(request, item.handle, item.seq)
            self.pump()
            return
        try:
            reply = await self.ports.dispatch(worker_id, request, item.handle.headers)
        except (UpstreamTimeout, NoResponders) as e:
            # the worker may still accept it late (or hold it, its subscription not back after a
            # reconnect): cancel it there before it can run in two places
            await self.ports.control(worker_id, ref.cancel())
            reply = DispatchReply(accepted=False, worker_id=worker_id, error=e.to_body())
        except LorafleetError as e:
            reply = DispatchReply(accepted=False, worker_id=worker_id, error=e.to_body())
        if reply.accepted:
            await self._accepted(item, worker_id)
            self.pump()
            return
        if not shadow:
            await self.dispatched.release(request.tenant_id, request.request_id, item.seq)
        if reply.error is not None and reply.error.status < 500:
            self.fleet.refused(worker_id, ref, back_off=False)
            await self._forget(item, from_body(reply.error))
            await item.handle.term()
        else:
            error = reply.error.message if reply.error else "refused"
            log.info("dispatch_failed", worker_id=worker_id, request_id=request.request_id, error=error)
            self.fleet.refused(worker_id, ref, back_off=True)
            if item.cancelled:  # its client left meanwhile: not queued again
                await self._forget(item)
                await item.handle.term()
            elif ref in self.held:
                self.queue.push(item, front=True)
        self.pump()

    async def _accepted(self, item: Queued, worker_id: str) -> None:
        request, rid, ref = item.request, item.request_id, item.ref
        self.held.pop(ref, None)
        self.inflight[ref] = Inflight(request, worker_id, item.grant, item.seq)
        self.fleet.accepted(worker_id)
        metrics.SCHEDULER_DISPATCHES.labels(worker_id).inc()
        if item.grant is None:  # a shadow run: charged to no tenant, its fair share included
            metrics.SHADOW_RUNS.labels("dispatched").inc()
        else:
            self.queue.charge(request.tenant_id, *token_cost(request))
        waited = time.monotonic() - item.enqueued
        metrics.SCHEDULER_QUEUE_WAIT.labels(item.priority).observe(waited * 1000)
        if waited > self.shedder.targets.of(item.priority):
            metrics.SLO_MISSES.labels(item.priority).inc()
        log.info("dispatched", request_id=rid, worker_id=worker_id, tenant=request.tenant_id)
        ended = self.early.pop(ref, {}).get(worker_id)  # other workers' runs of it were withdrawn
        try:
            await item.handle.ack()
            key = adapter_key_of(request)
            if key is not None:
                await self.heat.bump(key)
        finally:  # a failed ack must not leave a run that already ended holding its worker
            if ended is not None:
                await self.completed(ended)
        if item.cancelled:  # its client left while it was being dispatched
            await self._cancel_dispatched(ref)
        else:
            self._shadow(request)

    def _shadow(self, request: InferRequest) -> None:
        """Queue the canary's run of a production request marked for the shadow, at the batch class
        and charged to nobody: off the client's path, which its production run alone serves. Past
        ``max_inflight`` shadow runs held or running, the request goes unshadowed."""
        shadow = shadow_of(request, self.ports.catalog.catalog, self.shedder.targets.of("batch"))
        if shadow is None:
            return
        live = sum(q.request.shadow_of is not None for q in self.held.values())
        live += sum(e.request.shadow_of is not None for e in self.inflight.values())
        if live >= self.shadow.max_inflight:
            metrics.SHADOW_RUNS.labels("skipped").inc()
            return
        item = Queued(shadow, ShadowHandle(), None)
        if item.ref in self.held or item.ref in self.inflight:
            return
        self.held[item.ref] = item
        self.queue.push(item)
        self.pump()

    async def completed(self, event: CompletionAudit) -> None:
        """A worker finished a request: free its concurrency slot, refund its unused tokens, and
        correct its tenant's fairness counter from the estimate to what it really used. Only the
        run on the worker that took it ends it: a run withdrawn from another worker (its dispatch
        timed out, or the bus dropped its reply) may end there before or after."""
        ref = RequestRef(event.tenant_id, event.request_id)
        entry = self.inflight.get(ref)
        if entry is None:
            if ref in self.held:
                self.early.setdefault(ref, {})[event.worker_id] = event
            return
        if entry.worker_id != event.worker_id:
            return  # another run
        del self.inflight[ref]
        self.fleet.ended(entry.worker_id, ref, event.ts)
        if entry.grant is None:
            return  # a shadow run: nothing charged, and no client's wait to learn the service rate from
        if event.outcome in ("stop", "length"):  # what a served request costs the fleet
            self.shedder.ended(time.monotonic() - entry.started, event.ttft_ms / 1000)
        prompt_est, max_tokens = token_cost(entry.request)
        self.queue.charge(
            entry.request.tenant_id, event.prompt_tokens - prompt_est, event.completion_tokens - max_tokens
        )
        await self.admission.release(entry.grant, event.prompt_tokens + event.completion_tokens)
        self.pump()

    async def cancel(self, ref: RequestRef) -> bool:
        """Drop a request queued here (its client left), else cancel it on its worker, which a gateway that lost
        its accept notice cannot name: at once, or as soon as one accepts it; False if it is not held here."""
        item = self.queue.remove(ref)
        if item is None:
            return await self._cancel_dispatched(ref)
        await self._forget(item)
        await item.handle.term()
        log.info("queued_request_cancelled", request_id=ref.request_id, tenant=ref.tenant)
        return True

    async def _cancel_dispatched(self, ref: RequestRef) -> bool:
        if (dispatching := self.held.get(ref)) is not None:
            dispatching.cancelled = True  # ``_accepted`` sends the cancel once it knows the worker
            return True
        if (running := self.inflight.get(ref)) is None:
            return False
        await self.ports.control(running.worker_id, ref.cancel())
        log.info("running_request_cancelled", request_id=ref.request_id, worker_id=running.worker_id)
        return True

    async def drop_queued(self, item: Queued, error: LorafleetError) -> None:
        """Take ``item`` out of the scheduler: answer and audit ``error``, free its quota, terminate it."""
        self.queue.remove(item.ref)
        await self._forget(item, error)
        await item.handle.term()

    async def _forget(self, item: Queued, error: LorafleetError | None = None) -> None:
        """Let go of a request that will not run from this delivery: it leaves the held and early maps,
        ``error`` (if any) is answered and audited, and its quota grant is released unused. Its
        handle is the caller's to settle."""
        self.held.pop(item.ref, None)
        self.early.pop(item.ref, None)
        if error is not None and item.request.shadow_of is not None:  # no client waits on a shadow run
            metrics.SHADOW_RUNS.labels("dropped").inc()
            log.info("shadow_dropped", request_id=item.request_id, shadow_of=item.request.shadow_of, error=error.code)
        elif error is not None:
            await self._refuse(item.request, error)
        await self.admission.release(item.grant, 0)

    async def _refuse(self, request: InferRequest, error: LorafleetError) -> None:
        await self._refuse_raw((request.tenant_id, request.request_id, request.reply_to), error)

    async def _refuse_raw(self, target: tuple[str, str, str | None], error: LorafleetError) -> None:
        tenant, rid, reply_to = target
        metrics.REQUESTS.labels("scheduler", error.code).inc()
        if reply_to is not None:
            await self.ports.reply_error(reply_to, rid, error.answer if isinstance(error, IsolationAttempt) else error)
        await self.ports.record_rejection(tenant, rid, error)

    async def shutdown(self, timeout_s: float) -> None:
        """Let dispatches in progress finish, then hand every queued request back to the work queue."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        for item in list(self.held.values()):
            await item.handle.nak()
        self.held.clear()
        self.early.clear()
