"""A stand-in for scheduler + worker: answers every submitted InferRequest on its reply inbox.

Core NATS subscribers see JetStream publishes too, so this listens on ``lf.infer.submit.>``.
The answer echoes what the request carried (model, adapter, sampling) so tests can check the
gateway passed it on. A prompt containing "slow" streams a token every 20 ms until cancelled; "quota" is refused as
the scheduler refuses a tenant over its limits. Asked for prompt logprobs, it sends one entry per word of the
prompt (word i: logprob -i, none for the first) in pieces of two words; a prompt containing "lose-piece" loses
the first piece on its way; one containing "lose-accept" loses its accept notice.
"""

import asyncio
import json
import re
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS

from shared import subjects
from shared.bus import decode, encode
from shared.errors import QuotaExceeded
from shared.schemas import (
    ChargeReply,
    InferRequest,
    ReplyAccepted,
    ReplyEnvelope,
    ReplyError,
    ReplyFinal,
    ReplyPromptLogprobs,
    ReplyToken,
    ServedBy,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerControl,
)

WORKER_ID = "fake-worker"


@dataclass
class FakeWorker:
    nc: NATS
    requests: list[InferRequest] = field(default_factory=list)
    cancelled: set[str] = field(default_factory=set)
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def start(self) -> None:
        await self.nc.subscribe(subjects.INFER_SUBMIT_ALL, cb=self._on_submit)
        await self.nc.subscribe(subjects.worker_control(WORKER_ID), cb=self._on_control)
        await self.nc.subscribe(subjects.SCHEDULER_CHARGE, cb=self._on_charge)

    async def _on_charge(self, msg) -> None:
        """The scheduler's charge of a feedback post: always within quota here."""
        await msg.respond(encode(ChargeReply()))

    async def _on_control(self, msg) -> None:
        control = decode(WorkerControl, msg.data)
        if control.action == "cancel" and control.request_id:
            self.cancelled.add(control.request_id)

    async def _on_submit(self, msg) -> None:
        request = decode(InferRequest, msg.data)
        self.requests.append(request)
        self.tasks.append(asyncio.create_task(self._answer(request)))

    async def _send(self, request: InferRequest, body) -> None:
        await self.nc.publish(request.reply_to, encode(ReplyEnvelope(body=body)))

    async def _send_prompt_logprobs(self, request: InferRequest, text: str, k: int) -> None:
        words = re.findall(r"\s*\S+", text)
        entries = [
            TokenLogprob(
                token=word,
                logprob=None if i == 0 else -float(i),
                bytes=list(word.encode()),
                top_logprobs=[]
                if i == 0
                else [TopLogprob(token=f"alt{j}", logprob=-0.5 - j, bytes=[]) for j in range(k)],
            )
            for i, word in enumerate(words)
        ]
        for start in range(2 if "lose-piece" in text else 0, len(entries), 2):
            piece = ReplyPromptLogprobs(
                request_id=request.request_id, start=start, total=len(entries), entries=entries[start : start + 2]
            )
            await self._send(request, piece)

    async def _answer(self, request: InferRequest) -> None:
        rid = request.request_id
        text = request.prompt if request.prompt is not None else request.messages[-1].content
        if "quota" in text:
            error = QuotaExceeded("tenant is over 10 requests/min", retry_after_s=2.6).to_body()
            await self._send(request, ReplyError(request_id=rid, error=error))
            return
        told = None if "untold-hit" in text else True  # a worker tells no hit for an adapter not the tenant's own
        if "lose-accept" not in text:  # else the accept notice is lost on its way (a NATS node failing over)
            await self._send(request, ReplyAccepted(request_id=rid, worker_id=WORKER_ID, cache_hit=told))
        s = request.sampling
        echo = json.dumps(
            {
                "adapter": request.adapter.adapter_id if request.adapter else None,
                "seed": s.seed,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "stop": s.stop,
                "max_tokens": s.max_tokens,
            }
        )
        if s.prompt_logprobs is not None:
            await self._send_prompt_logprobs(request, text, s.prompt_logprobs)
        if "dump-sampling" in text:  # every sampling field as the worker received it
            echo = s.model_dump_json()
        if "dump-chat" in text:  # the messages and tools as the worker received them
            echo = request.model_dump_json(include={"messages", "tools"})
        pieces = ["echo:", echo]
        if "slow" in text:
            pieces = [f" t{i}" for i in range(500)]
        sent: list[str] = []
        for i, piece in enumerate(pieces):
            if rid in self.cancelled:
                break
            sent.append(piece)
            logprobs = [TokenLogprob(token=piece, logprob=-0.25, bytes=list(piece.encode()))] if s.logprobs else None
            await self._send(request, ReplyToken(request_id=rid, index=i, text=piece, token_ids=[i], logprobs=logprobs))
            if "slow" in text:
                await asyncio.sleep(0.02)
        reason = "cancelled" if rid in self.cancelled else "stop"
        served = ServedBy(worker_id=WORKER_ID, base_model=request.base_model)
        await self._send(
            request,
            ReplyFinal(
                request_id=rid,
                text="".join(sent),
                finish_reason=reason,
                usage=Usage(prompt_tokens=len(text.split()), completion_tokens=len(sent)),
                served_by=served,
                ttft_ms=1.0,
                tpot_ms=1.0,
            ),
        )
