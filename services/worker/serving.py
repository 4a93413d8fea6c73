"""Serve one dispatched request on the engine: tokenise, stream replies, finish with usage and audit.

NATS-free: replies and audit records go out through injected callables."""

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog
from transformers import PreTrainedTokenizerBase

from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.sequence import EngineRequest
from shared import metrics
from shared.telemetry import tracer
from shared.errors import InvalidRequest, LorafleetError, ServiceUnavailable
from shared.schemas import (
    CompletionAudit, InferRequest, ReplyAccepted, ReplyError, ReplyFinal, ReplyMessage, ReplyToken, ServedBy, Usage,
)

log = structlog.get_logger("worker")
_tracer = tracer("worker")

Emit = Callable[[str, ReplyMessage], Awaitable[None]]
Audit = Callable[[CompletionAudit], Awaitable[None]]


@dataclass(slots=True)
class Timing:
    start: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def ttft_ms(self) -> float:
        return ((self.first_token or time.monotonic()) - self.start) * 1000

    def tpot_ms(self) -> float:
        if self.tokens < 2 or self.first_token is None or self.last_token is None:
            return 0.0
        return (self.last_token - self.first_token) * 1000 / (self.tokens - 1)


class RequestServer:
    """Accepts dispatched requests up to a waiting bound and runs each as a task on the engine."""

    def __init__(self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, worker_id: str, base_model: str,
                 emit: Emit, audit: Audit, max_waiting: int):
        self.engine = engine
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.base_model = base_model
        self.emit = emit
        self.audit = audit
        self.max_waiting = max_waiting
        self.tasks: dict[str, asyncio.Task] = {}
        self._adapter_label = metrics.BoundedLabel(50)
        self._recent: OrderedDict[str, None] = OrderedDict()

    def tokenize(self, request: InferRequest) -> list[int]:
        if request.messages is not None:
            ids = self.tokenizer.apply_chat_template(
                [m.model_dump() for m in request.messages], add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tokenizer(request.prompt, add_special_tokens=False)["input_ids"]
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenisation", param="prompt")
        return list(ids)

    async def accept(self, request: InferRequest) -> None:
        """Take the request or raise a typed error; a duplicate dispatch is accepted without a rerun."""
        if request.request_id in self._recent:
            log.info("duplicate_dispatch", request_id=request.request_id)
            return
        if request.base_model != self.base_model:
            raise InvalidRequest(f"this worker serves {self.base_model}, not {request.base_model}")
        if self.engine.stats().waiting >= self.max_waiting:
            raise ServiceUnavailable("worker queue is full")
        prompt_ids = self.tokenize(request)
        self._remember(request.request_id)
        await self.emit(request.reply_to, ReplyAccepted(request_id=request.request_id, worker_id=self.worker_id,
                                                        cache_hit=True))
        task = asyncio.create_task(self._serve(request, prompt_ids))
        self.tasks[request.request_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(request.request_id, None))

    def cancel(self, request_id: str) -> bool:
        task = self.tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def _remember(self, request_id: str) -> None:
        self._recent[request_id] = None
        while len(self._recent) > 10_000:
            self._recent.popitem(last=False)

    def _observe(self, outcome: str, timing: Timing, cache_hit: bool, adapter: str) -> None:
        hit = "true" if cache_hit else "false"
        metrics.REQUESTS.labels("worker", outcome).inc()
        if timing.first_token is not None:
            metrics.TTFT.labels(hit).observe(timing.ttft_ms())
        if timing.tokens >= 2:
            metrics.TPOT.labels(hit).observe(timing.tpot_ms())
        metrics.ADAPTER_TOKENS.labels(self._adapter_label(adapter)).inc(timing.tokens)

    async def _serve(self, request: InferRequest, prompt_ids: list[int]) -> None:
        with _tracer.start_as_current_span("worker.generate", attributes={"lf.request_id": request.request_id}):
            await self._generate(request, prompt_ids)

    async def _generate(self, request: InferRequest, prompt_ids: list[int]) -> None:
        timing = Timing(start=time.monotonic())
        rid, reply = request.request_id, request.reply_to
        pieces: list[str] = []
        outcome, usage = "error", Usage(prompt_tokens=len(prompt_ids), completion_tokens=0)
        try:
            async for out in self.engine.generate(EngineRequest(rid, prompt_ids, request.sampling)):
                now = time.monotonic()
                if out.token_ids:
                    timing.first_token = timing.first_token or now
                    timing.last_token = now
                    timing.tokens = out.completion_tokens
                if out.text or out.token_ids:
                    pieces.append(out.text)
                    await self.emit(reply, ReplyToken(request_id=rid, index=out.completion_tokens - 1,
                                                      text=out.text, token_ids=out.token_ids))
                if out.finished:
                    outcome = "cancelled" if out.finish_reason == "abort" else out.finish_reason
                    usage = Usage(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
            await self.emit(reply, ReplyFinal(
                request_id=rid, text="".join(pieces), finish_reason=outcome, usage=usage,
                served_by=ServedBy(worker_id=self.worker_id, base_model=self.base_model, cache_hit=True),
                ttft_ms=timing.ttft_ms(), tpot_ms=timing.tpot_ms()))
        except asyncio.CancelledError:
            outcome = "cancelled"
            log.info("request_cancelled", request_id=rid)
        except LorafleetError as e:
            await self.emit(reply, ReplyError(request_id=rid, error=e.to_body()))
        except Exception as e:
            log.exception("request_failed", request_id=rid)
            await self.emit(reply, ReplyError(request_id=rid, error=ServiceUnavailable(
                f"worker failed while generating: {type(e).__name__}").to_body()))
        finally:
            self._observe(outcome, timing, cache_hit=True, adapter="base")
            await self.audit(CompletionAudit(
                request_id=rid, tenant_id=request.tenant_id, base_model=self.base_model, cache_hit=True,
                ttft_ms=timing.ttft_ms(), tpot_ms=timing.tpot_ms(), prompt_tokens=usage.prompt_tokens,
                completion_tokens=timing.tokens, worker_id=self.worker_id, outcome=outcome))
