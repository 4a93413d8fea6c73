"""Submit an InferRequest on JetStream and relay its reply stream, with bounded waits."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import structlog
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from shared import subjects
from shared.bus import decode, encode
from shared.errors import (
    LorafleetError,
    NoWorkerAvailable,
    ServiceUnavailable,
    UpstreamTimeout,
    from_body,
)
from shared.publish_refusals import publish_failing_over, publish_refusal
from shared.request_ref import RequestRef
from shared.schemas import (
    InferRequest,
    ReplyAccepted,
    ReplyEnvelope,
    ReplyError,
    ReplyFinal,
    ReplyPromptLogprobs,
    ReplyToken,
)
from shared.telemetry import inject, tracer

log = structlog.get_logger("gateway.inference")
_tracer = tracer("gateway")
_Reply = ReplyAccepted | ReplyPromptLogprobs | ReplyToken | ReplyFinal | ReplyError  # a ReplyEnvelope's body
Event = ReplyPromptLogprobs | ReplyToken | ReplyFinal  # what a submission relays


@dataclass(slots=True)
class Submission:
    """One in-flight request: its accept notice, then tokens, then a final message."""

    request: InferRequest
    accepted: ReplyAccepted
    _queue: asyncio.Queue[_Reply]
    _sub: Subscription
    _nc: NATS
    _deadline: float
    finished: bool = False

    async def events(self) -> AsyncIterator[Event]:
        """The prompt's logprobs (when asked), tokens, then the final message; a remote error, a lost
        token or prompt entry, or the deadline raises a typed error."""
        relayed = 0  # tokens passed on so far: the reply stream must account for every one
        scored, prompt_total = 0, 0  # prompt entries passed on so far, of how many
        try:
            while True:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise UpstreamTimeout(f"request {self.request.request_id} exceeded {self.request.timeout_s:.0f}s")
                try:
                    body = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    continue
                if isinstance(body, ReplyError):
                    self.finished = True
                    raise from_body(body.error)
                if isinstance(body, ReplyAccepted):
                    continue
                if isinstance(body, ReplyPromptLogprobs):
                    scored, prompt_total = self._check_prompt(body, scored), body.total
                else:
                    if relayed == 0 and isinstance(body, ReplyToken):
                        self._check_prompt_done(scored, prompt_total)
                    relayed = self._check_complete(body, relayed)
                yield body
                if isinstance(body, ReplyFinal):
                    self.finished = True
                    return
        finally:
            await self.close()

    def _check_prompt(self, body: ReplyPromptLogprobs, scored: int) -> int:
        """Prompt entries relayed after ``body``, which must continue them (and must have been asked for)."""
        if self.request.sampling.prompt_logprobs is None or body.start != scored:
            raise ServiceUnavailable(f"the reply stream of {self.request.request_id} lost prompt logprobs; retry it")
        return scored + len(body.entries)

    def _check_prompt_done(self, scored: int, total: int) -> None:
        """The prompt's logprobs, when asked, are all in before the first token."""
        if self.request.sampling.prompt_logprobs is not None and (scored == 0 or scored != total):
            raise ServiceUnavailable(f"the reply stream of {self.request.request_id} lost prompt logprobs; retry it")

    def _check_complete(self, body: ReplyToken | ReplyFinal, relayed: int) -> int:
        """Tokens relayed after ``body``; a gap (a reply lost on the bus, e.g. while NATS reconnected)
        fails the request rather than handing the client a text with a hole in it."""
        if isinstance(body, ReplyToken):
            if body.index + 1 - len(body.token_ids) != relayed:
                log.warning("reply_tokens_lost", request_id=self.request.request_id, relayed=relayed, index=body.index)
                raise ServiceUnavailable(f"the reply stream of {self.request.request_id} lost tokens; retry it")
            return body.index + 1
        if body.finish_reason != "cancelled" and body.usage.completion_tokens != relayed:
            log.warning(
                "reply_tokens_lost",
                request_id=self.request.request_id,
                relayed=relayed,
                completion_tokens=body.usage.completion_tokens,
            )
            raise ServiceUnavailable(f"the reply stream of {self.request.request_id} lost its last tokens; retry it")
        return relayed

    async def close(self) -> None:
        """Stop listening; if the request has not finished, cancel it on its worker."""
        if not self.finished:
            self.finished = True
            cancel = RequestRef.of(self.request).cancel()
            try:
                await self._nc.publish(subjects.worker_control(self.accepted.worker_id), encode(cancel))
            except Exception as e:
                log.warning("cancel_publish_failed", request_id=self.request.request_id, error=str(e))
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


async def _cancel_at_scheduler(nc: NATS, request: InferRequest) -> None:
    """Cancel a request whose worker this gateway does not know: the scheduler drops it from its queue,
    or cancels it on the worker it gave it to."""
    try:
        await nc.publish(subjects.SCHEDULER_CANCEL, encode(RequestRef.of(request).cancel()))
    except Exception as e:
        log.warning("cancel_publish_failed", request_id=request.request_id, error=str(e))


PUBLISH_RETRY_S = 0.25


async def _publish(js: JetStreamContext, request: InferRequest, preview: bool, deadline: float) -> None:
    """Store the submission on INFER. While the stream has no leader (a NATS node failing over: no
    responder on its subject, or JetStream's own temporarily-unavailable answers) try again until
    ``deadline`` (epoch seconds); the message id makes a retry of a submission that was stored after
    all a duplicate the stream drops."""
    subject = subjects.infer_submit(request.tenant_id, subjects.VIA_PREVIEW if preview else subjects.VIA_GATEWAY)
    data, headers = encode(request), inject({"Nats-Msg-Id": request.request_id})
    while True:
        left = deadline - time.time()
        try:
            await js.publish(subject, data, headers=headers, timeout=max(0.1, left))
            return
        except (NoStreamResponseError, APIError) as e:
            failing_over = isinstance(e, NoStreamResponseError) or publish_failing_over(e)
            if not failing_over or left <= PUBLISH_RETRY_S:
                raise
            await asyncio.sleep(PUBLISH_RETRY_S)


async def submit(
    nc: NATS, js: JetStreamContext, request_fields: dict, accept_timeout_s: float, preview: bool = False
) -> Submission:
    """Publish the request and wait until a worker accepts it (else 503 within the bound); ``preview``
    submits on the subject where a pinned staging version may be served."""
    queue: asyncio.Queue[_Reply] = asyncio.Queue()
    inbox = nc.new_inbox()
    request_id = request_fields["request_id"]

    async def on_reply(msg) -> None:
        try:
            body = decode(ReplyEnvelope, msg.data).body
        except Exception as e:
            log.warning("bad_reply_message", error=str(e))
            return
        if body.request_id != request_id:  # whoever learnt this inbox cannot write into another stream
            log.warning("foreign_reply_dropped", request_id=request_id, claimed=body.request_id)
            return
        queue.put_nowait(body)

    sub = await nc.subscribe(inbox, cb=on_reply)
    accept_deadline = time.time() + accept_timeout_s
    request = InferRequest(reply_to=inbox, accept_deadline=accept_deadline, **request_fields)
    try:
        with _tracer.start_as_current_span("gateway.publish"):
            await _publish(js, request, preview, accept_deadline)
    except (NoStreamResponseError, TimeoutError) as e:
        await sub.unsubscribe()
        raise ServiceUnavailable(f"the request queue is not available ({type(e).__name__})") from None
    except APIError as e:  # over the INFER stream's bounds: the tenant's backlog, or the whole queue
        await sub.unsubscribe()
        raise publish_refusal(e) from None
    deadline = time.monotonic() + request.timeout_s
    try:
        first = await asyncio.wait_for(queue.get(), accept_timeout_s)
    except (TimeoutError, asyncio.CancelledError) as e:
        # nobody waits any more: drop it from the scheduler's queue (or its worker) too
        await sub.unsubscribe()
        await _cancel_at_scheduler(nc, request)
        if isinstance(e, asyncio.CancelledError):
            raise
        raise NoWorkerAvailable(f"no worker accepted the request within {accept_timeout_s:.0f}s") from None
    if isinstance(first, ReplyError):
        await sub.unsubscribe()
        raise from_body(first.error)
    if not isinstance(first, ReplyAccepted):  # the notice was lost on the bus (a NATS node failing over)
        await sub.unsubscribe()
        log.warning("reply_accept_lost", request_id=request.request_id, first=type(first).__name__)
        await _cancel_at_scheduler(nc, request)  # it runs on a worker the lost notice would have named
        raise ServiceUnavailable(
            f"the reply stream of {request.request_id} lost its accept notice; retry it", retry_after_s=1.0
        )
    return Submission(request, first, queue, sub, nc, deadline)


async def submit_all(
    nc: NATS, js: JetStreamContext, fields: list[dict], accept_timeout_s: float, preview: bool = False
) -> list[Submission]:
    """Submit the n choices of one request together; if any is refused, cancel the others."""
    results = await asyncio.gather(
        *(submit(nc, js, f, accept_timeout_s, preview) for f in fields), return_exceptions=True
    )
    subs = [r for r in results if isinstance(r, Submission)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for sub in subs:
            await sub.close()
        raise failed[0]
    return subs


async def merged(subs: list[Submission]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) from every submission as they arrive; the first error raises.
    Leaving early closes (cancels) every unfinished submission."""
    if len(subs) == 1:  # one choice: its events as they come, without a relay task and queue per token
        try:
            async for event in subs[0].events():
                yield 0, event
        finally:
            await subs[0].close()
        return
    # (choice, event); an error ends that choice, and None marks its end
    queue: asyncio.Queue[tuple[int, Event | LorafleetError | None]] = asyncio.Queue()

    async def pump(index: int, sub: Submission) -> None:
        try:
            async for event in sub.events():
                queue.put_nowait((index, event))
        except LorafleetError as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(subs)]
    try:
        running = len(subs)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, LorafleetError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for sub in subs:
            await sub.close()
