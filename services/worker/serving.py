"""Serve dispatched requests on the engine: adapter lookup, streaming replies, usage, audit.

NATS-free: replies and audit records go out through injected callables."""

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from services.worker import tool_grammar
from services.worker.adapter_cache.hierarchy import CacheHierarchy, Lookup
from services.worker.engine.sequence import EngineRequest
from services.worker.engine_port import WorkerEngine
from services.worker.prompt_ids import PromptIds
from services.worker.slo_attainment import SloAttainment, ttft_outcome
from services.worker.timing import Timing
from shared import metrics
from shared.adapter_keys import adapter_key
from shared.answer_digest import digest_answer
from shared.catalog.grants import IsolationAttempt
from shared.catalog.view import CatalogView
from shared.errors import IntegrityError, InvalidRequest, LorafleetError, ServiceUnavailable, UpstreamTimeout
from shared.request_ref import RequestRef
from shared.schemas import (
    CompletionAudit,
    InferRequest,
    RejectionAudit,
    ReplyAccepted,
    ReplyError,
    ReplyFinal,
    ReplyMessage,
    ReplyPromptLogprobs,
    ReplyToken,
    ServedBy,
    SloClass,
    TokenLogprob,
    Usage,
)
from shared.slot_size import class_of
from shared.telemetry import tracer

log = structlog.get_logger("worker")
_tracer = tracer("worker")

Emit = Callable[[str, ReplyMessage], Awaitable[None]]
Audit = Callable[[CompletionAudit | RejectionAudit], Awaitable[None]]
PROMPT_PIECE_BYTES = 256 * 1024  # a prompt-logprobs message's entries, well inside NATS' 1 MiB max_payload


def prompt_pieces(request_id: str, entries: list[TokenLogprob]) -> list[ReplyPromptLogprobs]:
    """The prompt's entries split into messages of at most about PROMPT_PIECE_BYTES of JSON each."""
    pieces: list[ReplyPromptLogprobs] = []
    start, size = 0, 0
    for end, entry in enumerate(entries):
        entry_size = len(entry.model_dump_json())
        if end > start and size + entry_size > PROMPT_PIECE_BYTES:
            pieces.append(
                ReplyPromptLogprobs(request_id=request_id, start=start, total=len(entries), entries=entries[start:end])
            )
            start, size = end, 0
        size += entry_size
    if start < len(entries):
        pieces.append(
            ReplyPromptLogprobs(request_id=request_id, start=start, total=len(entries), entries=entries[start:])
        )
    return pieces


@dataclass(slots=True)
class Job:
    request: InferRequest
    prompt_ids: list[int]
    key: str | None = None
    lookup: Lookup | None = None
    timing: Timing = field(default_factory=Timing)
    digest: str | None = None
    compared: list[int] | None = None  # output token ids kept for the answer's digest (a run compared in the shadow)

    @property
    def ref(self) -> RequestRef:
        return RequestRef.of(self.request)

    @property
    def slo_class(self) -> SloClass:
        return self.request.priority or "standard"  # None: it bypassed the scheduler

    owned: bool = True  # the adapter is the requester's own (or none: the base model)

    @property
    def cache_hit(self) -> bool:
        return self.lookup is None or self.lookup.hit

    @property
    def told_hit(self) -> bool | None:
        """What the requester is told of ``cache_hit``: nothing for an adapter it does not own, whose
        residency other tenants' traffic keeps up (the audit and the metrics keep the truth)."""
        return self.cache_hit if self.owned else None


class RequestServer:
    """Accepts dispatched requests up to a waiting bound and runs each as a task on the engine.
    Request ids are per tenant: every request map here, and the engine, know a request by its
    (tenant, request id), so two tenants' requests under one id run side by side."""

    def __init__(
        self,
        engine: WorkerEngine,
        prompts: PromptIds,
        worker_id: str,
        base_model: str,
        emit: Emit,
        audit: Audit,
        max_waiting: int,
        cache: CacheHierarchy | None = None,
        grants: CatalogView | None = None,
        adapter_metric_labels: int = 50,
        rank_classes: tuple[int, ...] = (),
        slo_window: int = 500,
        owner_of: Callable[[str], str | None] | None = None,
    ):
        self.engine = engine
        self.prompts = prompts
        self.worker_id = worker_id
        self.base_model = base_model
        self.emit = emit
        self.audit = audit
        self.max_waiting = max_waiting
        self.cache = cache
        self.grants = grants  # None: adapters are trusted as dispatched (tests without a registry)
        # adapter id -> owner tenant (the catalog mirror's); None: every requester is told (no registry)
        self.owner_of = owner_of
        self.tasks: dict[RequestRef, asyncio.Task] = {}
        self._jobs: dict[RequestRef, Job] = {}
        self._stop_errors: dict[RequestRef, LorafleetError] = {}
        self._adapter_label = metrics.TopLabels(
            adapter_metric_labels,
            (
                metrics.ADAPTER_TOKENS,
                metrics.ADAPTER_TTFT,
                metrics.ADAPTER_TPOT,
                metrics.ADAPTER_ENGINE_SECONDS,
                metrics.ADAPTER_ENGINE_TOKENS,
            ),
        )
        self.rank_classes = rank_classes  # the engine's, for the rank-class metric label
        self._slo = SloAttainment(slo_window)
        self._recent: OrderedDict[RequestRef, None] = OrderedDict()  # accepted or cancelled here
        self._cancelled: OrderedDict[RequestRef, None] = OrderedDict()

    async def accept(self, request: InferRequest) -> None:
        """Take the request or raise a typed error; a duplicate dispatch is accepted without a rerun."""
        ref = RequestRef.of(request)
        if request.adapter is not None and self.grants is not None and ref not in self._recent:
            await self._check_grant(request)  # before the checks below, which run with no await between
        if ref in self._recent:
            if ref in self._cancelled:
                raise ServiceUnavailable(f"request {request.request_id} was withdrawn from this worker")
            log.info("duplicate_dispatch", request_id=request.request_id)
            return
        if request.base_model != self.base_model:
            raise InvalidRequest(f"this worker serves {self.base_model}, not {request.base_model}")
        if self.engine.stats().waiting >= self.max_waiting:
            raise ServiceUnavailable("worker queue is full")
        prompt_ids = self.prompts.encode(request.messages, request.prompt, request.tools)
        tools = tool_grammar.constraint(request.tools)
        if tools is not None:
            request = request.model_copy(update={"sampling": request.sampling.model_copy(update={"structured": tools})})
        job = Job(request, prompt_ids, compared=[] if request.compare_tokens else None)
        if request.adapter is not None:
            if self.cache is None:
                raise InvalidRequest("this worker serves the base model only")
            job.key = adapter_key(request.adapter.adapter_id, request.adapter.version)
            job.owned = self.owner_of is None or self.owner_of(request.adapter.adapter_id) == request.tenant_id
            job.lookup = self.cache.acquire(
                job.key,
                request.adapter.rank,
                request.tenant_id,
                request.priority or "standard",
                request.tenant_gpu_slots,
                hard=request.tenant_slot_enforce == "hard",
            )
        self._remember(ref)
        self._jobs[ref] = job
        # the engine gets the request first; the accept notice (off the path to the first token)
        # is queued on the connection before the task can emit anything, so it still arrives first
        task = asyncio.create_task(self._serve(job))
        self.tasks[ref] = task
        task.add_done_callback(lambda _: self.tasks.pop(ref, None))
        await self.emit(
            request.reply_to,
            ReplyAccepted(request_id=request.request_id, worker_id=self.worker_id, cache_hit=job.told_hit),
        )

    async def _check_grant(self, request: InferRequest) -> None:
        """The adapter must be what the request's model resolves to for its tenant now (released, or
        staging on a preview), as the scheduler judged it: a worker never serves on trust alone."""
        assert self.grants is not None
        try:
            await self.grants.grant(request, request.preview)
        except IsolationAttempt as e:  # the scheduler audits it; the client gets the plain 404
            raise e.answer from None

    def cancel(self, ref: RequestRef, error: LorafleetError | None = None) -> bool:
        """Stop a request; with ``error`` its client gets that error instead of a cancelled finish."""
        # withdrawn either way: a dispatch that arrives late must not start it, and a re-dispatch of a
        # request cancelled while it ran is refused (typed) instead of acked as a duplicate that never runs
        self._remember(ref)
        self._cancelled[ref] = None
        while len(self._cancelled) > 10_000:
            self._cancelled.popitem(last=False)
        task = self.tasks.get(ref)
        if task is None:
            return False
        if error is not None:
            self._stop_errors[ref] = error
        task.cancel()
        return True

    def cancel_adapter(self, keys: list[str], error: LorafleetError) -> int:
        """Stop every request running on one of ``keys`` (a revoked adapter version)."""
        doomed = [ref for ref, job in self._jobs.items() if job.key in keys]
        return sum(self.cancel(ref, error) for ref in doomed)

    def _remember(self, ref: RequestRef) -> None:
        self._recent[ref] = None
        while len(self._recent) > 10_000:
            self._recent.popitem(last=False)

    async def _serve(self, job: Job) -> None:
        rid, ref = job.request.request_id, job.ref
        adapter = job.request.adapter
        structlog.contextvars.bind_contextvars(  # this task's own context: every log line names the request
            request_id=rid,
            tenant_id=job.request.tenant_id,
            adapter_id=adapter.adapter_id if adapter else None,
            adapter_version=adapter.version if adapter else None,
        )
        with _tracer.start_as_current_span(
            "worker.generate",
            attributes={"lf.request_id": rid, "lf.adapter": job.key or "", "lf.cache_hit": job.cache_hit},
        ):
            outcome, usage = "error", Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=0)
            try:
                await self._adapter_ready(job)
                outcome, usage = await self._generate(job)
            except asyncio.CancelledError:
                error = self._stop_errors.pop(ref, None)
                outcome = "error" if error else "cancelled"
                if error is not None:
                    await self.emit(job.request.reply_to, ReplyError(request_id=rid, error=error.to_body()))
                log.info("request_cancelled", request_id=rid, reason=error.code if error else "client")
            except LorafleetError as e:
                await self.emit(job.request.reply_to, ReplyError(request_id=rid, error=e.to_body()))
                if isinstance(e, IntegrityError):  # an integrity refusal is an audit event of its own
                    await self.audit(
                        RejectionAudit(
                            request_id=rid,
                            tenant_id=job.request.tenant_id,
                            service="worker",
                            code=e.code,
                            reason=e.message[:2000],
                        )
                    )
            except Exception as e:
                log.exception("request_failed", request_id=rid)
                failure = ServiceUnavailable(f"worker failed while generating: {type(e).__name__}")
                await self.emit(job.request.reply_to, ReplyError(request_id=rid, error=failure.to_body()))
            finally:
                self._jobs.pop(ref, None)
                if job.key is not None and self.cache is not None:
                    self.cache.release(job.key)
                self._observe(job, outcome)
                await self.audit(self._audit_record(job, outcome, usage))

    async def _adapter_ready(self, job: Job) -> None:
        """Wait alone for this request's adapter, then check it is the exact version granted."""
        if job.lookup is None:
            return
        granted = job.request.adapter
        assert job.key is not None and granted is not None, "submit sets the key and lookup of an adapter request"
        if not job.lookup.hit:
            with _tracer.start_as_current_span("worker.adapter_load", attributes={"lf.tier": job.lookup.tier}):
                # bounded by the request's own deadline: a load held to a hard slot quota waits for a slot of
                # the tenant's own; waiting on a copy of the shared future leaves it to the other waiters
                left = job.request.created_at + job.request.timeout_s - time.time()
                loaded = asyncio.wrap_future(job.lookup.ready)
                done, _ = await asyncio.wait({loaded}, timeout=max(0.0, left))
                if not done:
                    raise UpstreamTimeout(f"{job.key}: no GPU slot was free within the request's timeout")
                loaded.result()
        job.digest = job.lookup.ready.result().digest  # the weights in the slot, verified as they were fetched
        if job.digest is not None and job.digest != granted.digest:
            metrics.INTEGRITY_ERRORS.labels("worker").inc()
            raise IntegrityError(
                f"{job.key}: loaded weights {job.digest[:12]} are not the granted {granted.digest[:12]}"
            )

    async def _generate(self, job: Job) -> tuple[str, Usage]:
        request, rid = job.request, job.request.request_id
        pieces: list[str] = []
        outcome, usage = "error", Usage(prompt_tokens=len(job.prompt_ids), completion_tokens=0)
        # Cached prompt K/V is shared only within a tenant, and only for the exact adapter weights.
        salt = f"{request.tenant_id}/{job.digest or ''}"
        engine_request = EngineRequest(
            job.ref.engine_id(),
            job.prompt_ids,
            request.sampling,
            adapter=job.key,
            cache_salt=salt,
            slo_class=job.slo_class,
            tenant=request.tenant_id,
        )
        async for out in self.engine.generate(engine_request):
            job.timing.charged(out.engine_s)
            for piece in prompt_pieces(rid, out.prompt_logprobs or []):
                await self.emit(request.reply_to, piece)
            if out.token_ids:
                job.timing.token(out.completion_tokens)
                if job.compared is not None and request.compare_tokens is not None:
                    job.compared.extend(out.token_ids[: request.compare_tokens - len(job.compared)])
            if out.text or out.token_ids:
                pieces.append(out.text)
                await self.emit(
                    request.reply_to,
                    ReplyToken(
                        request_id=rid,
                        index=out.completion_tokens - 1,
                        text=out.text,
                        token_ids=out.token_ids,
                        logprobs=out.token_logprobs,
                    ),
                )
            if out.finished:
                assert out.finish_reason is not None, "a finished output names its reason"
                outcome = "cancelled" if out.finish_reason == "abort" else out.finish_reason
                usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
        adapter = request.adapter
        served = ServedBy(
            worker_id=self.worker_id,
            base_model=self.base_model,
            cache_hit=job.told_hit,
            adapter_id=adapter.adapter_id if adapter else None,
            adapter_version=adapter.version if adapter else None,
            adapter_digest=job.digest,
        )
        await self.emit(
            request.reply_to,
            ReplyFinal(
                request_id=rid,
                text="".join(pieces),
                finish_reason=outcome,
                usage=usage,
                served_by=served,
                ttft_ms=job.timing.ttft_ms(),
                tpot_ms=job.timing.tpot_ms(),
            ),
        )
        return outcome, usage

    def _observe(self, job: Job, outcome: str) -> None:
        hit = "true" if job.cache_hit else "false"
        adapter = self._adapter_label(job.key or "base")
        rank_class = self._rank_class(job.request)
        metrics.REQUESTS.labels("worker", outcome).inc()
        if job.timing.first_token is not None:
            ttft = job.timing.ttft_ms()
            metrics.TTFT.labels(hit).observe(ttft)
            metrics.ADAPTER_TTFT.labels(adapter).observe(ttft)
            metrics.RANK_CLASS_TTFT.labels(rank_class).observe(ttft)
        if job.timing.tokens >= 2:
            tpot = job.timing.tpot_ms()
            metrics.TPOT.labels(hit).observe(tpot)
            metrics.ADAPTER_TPOT.labels(adapter).observe(tpot)
            metrics.RANK_CLASS_TPOT.labels(rank_class).observe(tpot)
        metrics.ADAPTER_TOKENS.labels(adapter).inc(job.timing.tokens)
        if job.timing.engine_s is not None:  # both or neither: their ratio is never a made-up figure
            metrics.ADAPTER_ENGINE_SECONDS.labels(adapter).inc(job.timing.engine_s)
            metrics.ADAPTER_ENGINE_TOKENS.labels(adapter).inc(job.timing.tokens)
        self._observe_slo(job, outcome)

    def _observe_slo(self, job: Job, outcome: str) -> None:
        """TTFT from the scheduler's admission (wall clocks of two processes: skew counts in it) and
        TPOT by class; met or missed against the class's target, when the scheduler set one."""
        slo_class, timing, request = job.slo_class, job.timing, job.request
        if timing.first_token_wall is not None:
            metrics.SLO_TTFT.labels(slo_class).observe(max(0.0, timing.first_token_wall - request.created_at) * 1000)
        if timing.tokens >= 2:
            metrics.SLO_TPOT.labels(slo_class).observe(timing.tpot_ms())
        counted = ttft_outcome(request.created_at, timing.first_token_wall, request.ttft_target_s, outcome == "error")
        if counted is not None:
            self._slo.record(slo_class, counted)

    def _rank_class(self, request: InferRequest) -> str:
        """``base``, or the rank class holding the adapter (its own rank where no class is known)."""
        if request.adapter is None:
            return "base"
        return str(class_of(request.adapter.rank, self.rank_classes) or request.adapter.rank)

    def _audit_record(self, job: Job, outcome: str, usage: Usage) -> CompletionAudit:
        adapter = job.request.adapter
        return CompletionAudit(
            request_id=job.request.request_id,
            tenant_id=job.request.tenant_id,
            base_model=self.base_model,
            adapter_id=adapter.adapter_id if adapter else None,
            adapter_version=adapter.version if adapter else None,
            adapter_rank=adapter.rank if adapter else None,
            adapter_digest=job.digest,
            cache_hit=job.cache_hit,
            ttft_ms=job.timing.ttft_ms(),
            tpot_ms=job.timing.tpot_ms(),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=job.timing.tokens,
            worker_id=self.worker_id,
            outcome=outcome,
            slo_class=job.slo_class,
            task=job.request.task,
            experiment=job.request.experiment,
            arm=job.request.arm,
            engine_s=job.timing.engine_s,
            shadow_of=job.request.shadow_of,
            answer=digest_answer(job.compared) if job.compared is not None and outcome in ("stop", "length") else None,
        )
