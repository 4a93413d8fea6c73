"""How the registry asks a version an eval item: an ordinary InferRequest on the INFER stream, the
path a user's request takes (scheduler: quota, grant, placement; worker: the engine), on the owner
tenant's preview subject (where a pinned staging version may be served), greedy, pinned to exactly
``<adapter>@<version>``. Its request ids start ``platform-eval.``: the registry's own submissions."""

import asyncio
import time
import uuid

from nats.aio.client import Client as NATS
from nats.js.errors import APIError, NoStreamResponseError

from services.registry.evaluation import Ask
from shared import subjects
from shared.bus import decode, encode
from shared.errors import LorafleetError, ServiceUnavailable, UpstreamTimeout, from_body
from shared.eval_set import EvalItem
from shared.publish_refusals import publish_refusal
from shared.schemas import InferRequest, ReplyEnvelope, ReplyError, ReplyFinal, SamplingParams

REQUEST_PREFIX = "platform-eval"


def asker(nc: NATS, tenant_id: str, base_model: str, timeout_s: float) -> Ask:
    """An ``Ask`` submitting as ``tenant_id`` (the version's owner: the one tenant the isolation rule
    lets use it) through the INFER stream, each answer awaited at most ``timeout_s``."""
    js = nc.jetstream()

    async def ask(model: str, item: EvalItem, max_tokens: int) -> str:
        request_id = f"{REQUEST_PREFIX}.{uuid.uuid4().hex}"
        inbox = nc.new_inbox()
        final: asyncio.Future[ReplyFinal] = asyncio.get_running_loop().create_future()

        async def on_reply(msg) -> None:
            try:
                body = decode(ReplyEnvelope, msg.data).body
            except LorafleetError:
                return
            if body.request_id != request_id or final.done():
                return
            if isinstance(body, ReplyError):
                final.set_exception(from_body(body.error))
            elif isinstance(body, ReplyFinal):
                final.set_result(body)

        sub = await nc.subscribe(inbox, cb=on_reply)
        try:
            request = InferRequest(
                request_id=request_id,
                tenant_id=tenant_id,
                model=model,
                request_key=request_id,
                base_model=base_model,
                prompt=item.prompt,
                messages=item.messages,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                reply_to=inbox,
                timeout_s=timeout_s,
                accept_deadline=time.time() + timeout_s,
            )
            subject = subjects.infer_submit(tenant_id, subjects.VIA_PREVIEW)
            try:
                await js.publish(subject, encode(request), headers={"Nats-Msg-Id": request_id}, timeout=timeout_s)
            except (NoStreamResponseError, TimeoutError) as e:
                raise ServiceUnavailable(f"the request queue is not available ({type(e).__name__})") from None
            except APIError as e:  # over the INFER stream's bounds, or failing over
                raise publish_refusal(e) from None
            try:
                return (await asyncio.wait_for(final, timeout_s)).text
            except TimeoutError:
                raise UpstreamTimeout(f"eval request {request_id} was not answered within {timeout_s:.0f}s") from None
        finally:
            await sub.unsubscribe()

    return ask
