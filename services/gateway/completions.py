"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

import uuid
from collections.abc import AsyncIterator

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.gateway.context import GatewayContext
from services.gateway.errors_http import error_payload
from services.gateway.inference import Submission, submit
from services.gateway.openai_format import ChunkWriter, full_response
from services.gateway.openai_schemas import ChatCompletionRequest, CompletionRequest
from shared import subjects
from shared.bus import request as bus_request
from shared.telemetry import tracer
from shared.errors import InvalidRequest, LorafleetError, NoWorkerAvailable, ServiceUnavailable
from shared.schemas import (
    ChatMessage, ListModelsReply, ListModelsRequest, ReplyFinal, ResolveReply, ResolveRequest, SamplingParams,
)

router = APIRouter()
_tracer = tracer("gateway")
log = structlog.get_logger("gateway")


def _ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


def _sampling(ctx: GatewayContext, body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    limit = ctx.settings.max_tokens_limit
    max_tokens = body.requested_max_tokens() or min(256, limit)
    if max_tokens > limit:
        raise InvalidRequest(f"max_tokens {max_tokens} exceeds the limit of {limit}", param="max_tokens")
    return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos)


async def _run(ctx: GatewayContext, tenant: str, body: ChatCompletionRequest | CompletionRequest,
               inputs: dict) -> JSONResponse | StreamingResponse:
    chat = isinstance(body, ChatCompletionRequest)
    request_id = uuid.uuid4().hex
    with _tracer.start_as_current_span("gateway.request", attributes={
            "lf.request_id": request_id, "lf.tenant_id": tenant, "lf.model": body.model}):
        return await _submit(ctx, tenant, body, chat, request_id, inputs)


async def _submit(ctx: GatewayContext, tenant: str, body: ChatCompletionRequest | CompletionRequest, chat: bool,
                  request_id: str, inputs: dict) -> JSONResponse | StreamingResponse:
    log_ = log.bind(request_id=request_id, tenant_id=tenant, model=body.model)
    sampling = _sampling(ctx, body)
    missing = ctx.cluster.unavailable()
    if missing == "worker":
        raise NoWorkerAvailable("no worker is available")
    if missing is not None:
        raise ServiceUnavailable(f"the {missing} is not available")
    resolved = await bus_request(
        ctx.nc, subjects.registry("resolve"),
        ResolveRequest(tenant_id=tenant, model=body.model, request_key=body.user or request_id),
        ResolveReply, ctx.settings.registry_timeout_s,
    )
    fields = dict(request_id=request_id, tenant_id=tenant, model=body.model, base_model=resolved.base_model,
                  adapter=resolved.adapter, sampling=sampling, stream=body.stream,
                  timeout_s=ctx.settings.request_timeout_s, **inputs)
    sub = await submit(ctx.nc, ctx.js, fields, ctx.settings.accept_timeout_s)
    headers = _served_headers(sub)
    log_.info("request_accepted", worker_id=sub.accepted.worker_id, cache_hit=sub.accepted.cache_hit)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        writer = ChunkWriter(chat, request_id, body.model, include_usage)
        return StreamingResponse(_sse(sub, writer), media_type="text/event-stream", headers=headers)
    final: ReplyFinal | None = None
    async for event in sub.events():
        if isinstance(event, ReplyFinal):
            final = event
    return JSONResponse(full_response(chat, request_id, body.model, final), headers=headers)


def _served_headers(sub: Submission) -> dict[str, str]:
    adapter = sub.request.adapter
    return {
        "x-lorafleet-request-id": sub.request.request_id,
        "x-lorafleet-adapter": adapter.adapter_id if adapter else "",
        "x-lorafleet-version": str(adapter.version) if adapter else "",
        "x-lorafleet-cache-hit": "true" if sub.accepted.cache_hit else "false",
        "x-lorafleet-worker": sub.accepted.worker_id,
    }


async def _sse(sub: Submission, writer: ChunkWriter) -> AsyncIterator[str]:
    """Stream chunks; a client that goes away cancels the request on its worker (Submission.close)."""
    yield writer.start()
    try:
        async for event in sub.events():
            if isinstance(event, ReplyFinal):
                yield writer.finish(event)
            elif event.text:
                yield writer.token(event.text)
    except LorafleetError as e:
        yield writer.error(error_payload(e))
    finally:
        await sub.close()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = _ctx(request)
    tenant = ctx.keys.tenant_of(request)
    messages = [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
    if sum(len(m.content) for m in messages) > ctx.settings.max_prompt_chars:
        raise InvalidRequest(f"messages exceed {ctx.settings.max_prompt_chars} characters", param="messages")
    return await _run(ctx, tenant, body, {"messages": messages})


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = _ctx(request)
    tenant = ctx.keys.tenant_of(request)
    if len(body.prompt) > ctx.settings.max_prompt_chars:
        raise InvalidRequest(f"prompt exceeds {ctx.settings.max_prompt_chars} characters", param="prompt")
    return await _run(ctx, tenant, body, {"prompt": body.prompt})


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    ctx = _ctx(request)
    tenant = ctx.keys.tenant_of(request)
    reply = await bus_request(ctx.nc, subjects.registry("list"), ListModelsRequest(tenant_id=tenant),
                              ListModelsReply, ctx.settings.registry_timeout_s)
    return {"object": "list", "data": [
        {"id": m.id, "object": "model", "created": m.created, "owned_by": m.owned_by} for m in reply.models
    ]}
