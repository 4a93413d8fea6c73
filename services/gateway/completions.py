"""POST /v1/chat/completions, POST /v1/completions, GET /v1/models."""

import hashlib
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway.auth import Principal, inference_caller
from services.gateway.context import GatewayContext
from services.gateway.disconnect import ClientDisconnected, unless_disconnected
from services.gateway.errors_http import error_payload
from services.gateway.inference import Submission, merged, submit_all
from services.gateway.openai_format import Choice, ChunkWriter, full_response
from services.gateway.openai_responses import (
    INFERENCE_ERRORS,
    SSE_RESPONSE,
    ChatCompletion,
    Completion,
    Model,
    ModelList,
    error_responses,
)
from services.gateway.openai_schemas import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from services.gateway.routing import RouteAsk, route_ask, routed
from shared import subjects
from shared.bus import request as bus_request
from shared.catalog.routing import TASK_PREFIX, task_not_found
from shared.errors import InvalidRequest, LorafleetError, ModelNotFound, NoWorkerAvailable, ServiceUnavailable
from shared.schemas import (
    SLO_CLASSES,
    ChatMessage,
    ListModelsReply,
    ListModelsRequest,
    ModelInfo,
    ReplyFinal,
    ReplyPromptLogprobs,
    ResolveRequest,
    SamplingParams,
    SloClass,
    StructuredOutput,
    TokenLogprob,
)
from shared.schemas.registry import MODEL_NAME_MAX
from shared.telemetry import tracer

router = APIRouter(tags=["inference"])
_tracer = tracer("gateway")
log = structlog.get_logger("gateway")
Body = ChatCompletionRequest | CompletionRequest
CLIENT_CLOSED = 499
PRIORITY_HEADER = "x-lorafleet-priority"


def _ctx(request: Request) -> GatewayContext:
    return request.app.state.ctx


def _sampling(ctx: GatewayContext, body: Body, index: int, structured: StructuredOutput | None) -> SamplingParams:
    s = ctx.settings
    max_tokens = body.requested_max_tokens() or min(256, s.max_tokens_limit)
    if max_tokens > s.max_tokens_limit:
        raise InvalidRequest(f"max_tokens {max_tokens} exceeds the limit of {s.max_tokens_limit}", param="max_tokens")
    if body.n > s.max_n:
        raise InvalidRequest(f"n {body.n} exceeds the limit of {s.max_n}", param="n")
    if len(body.stop_list()) > s.max_stop:
        raise InvalidRequest(f"{len(body.stop_list())} stop sequences exceed the limit of {s.max_stop}", param="stop")
    seed = None if body.seed is None else (body.seed + index) % 2**63  # distinct but reproducible choices
    logprobs, top_logprobs = body.requested_logprobs()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=seed,
        stop=body.stop_list(),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=body.bias(),
        stop_token_ids=body.stop_token_ids or [],
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=body.requested_prompt_logprobs() if isinstance(body, CompletionRequest) else None,
        structured=structured,
    )


async def _check_prompt(ctx: GatewayContext, inputs: dict) -> None:
    limit = ctx.settings.max_prompt_tokens
    if ctx.prompt_tokens is None or limit == 0:
        return
    count = await ctx.prompt_tokens.count(inputs.get("messages"), inputs.get("prompt"), inputs.get("tools"))
    if count > limit:
        raise InvalidRequest(
            f"the prompt has {count} tokens, over the limit of {limit}",
            param="messages" if "messages" in inputs else "prompt",
        )


def _priority(request: Request, body: Body) -> SloClass | None:
    """The SLO class the client asks for, in the header or the body (both: they must agree); the
    scheduler checks it against the tenant's tier, for direct-NATS clients too."""
    header = request.headers.get(PRIORITY_HEADER)
    if header is None:
        return body.priority
    value = header.strip().lower()
    for slo_class in SLO_CLASSES:
        if value == slo_class:
            if body.priority is not None and body.priority != slo_class:
                raise InvalidRequest(
                    f"the {PRIORITY_HEADER} header ({slo_class}) and the body's priority ({body.priority}) differ",
                    param="priority",
                )
            return slo_class
    raise InvalidRequest(
        f"{PRIORITY_HEADER} must be one of {', '.join(SLO_CLASSES)}, not {header[:32]!r}", param=PRIORITY_HEADER
    )


async def _answer(request: Request, run: Coroutine[Any, Any, Response]) -> Response:
    """The handler's response; a client gone before it is ready cancels the request downstream."""
    try:
        return await unless_disconnected(request, run)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: the nginx convention, for the logs


async def _run(
    ctx: GatewayContext, tenant: str, body: Body, inputs: dict, preview: bool, priority: SloClass | None, ask: RouteAsk
) -> JSONResponse | StreamingResponse:
    request_id = uuid.uuid4().hex
    with _tracer.start_as_current_span(
        "gateway.request", attributes={"lf.request_id": request_id, "lf.tenant_id": tenant, "lf.model": body.model}
    ):
        return await _submit(ctx, tenant, body, request_id, inputs, preview, priority, ask)


async def _submit(
    ctx: GatewayContext,
    tenant: str,
    body: Body,
    request_id: str,
    inputs: dict,
    preview: bool,
    priority: SloClass | None,
    ask: RouteAsk,
) -> JSONResponse | StreamingResponse:
    chat = isinstance(body, ChatCompletionRequest)
    structured = body.structured(ctx.settings)
    sampling = [_sampling(ctx, body, i, structured) for i in range(body.n)]
    await _check_prompt(ctx, inputs)
    missing = ctx.cluster.unavailable()
    if missing == "worker":
        raise NoWorkerAvailable("no worker is available")
    if missing is not None:
        raise ServiceUnavailable(f"the {missing} is not available")
    request_key = body.user or request_id
    route = routed(ctx, tenant, ask, request_key)
    resolved = await ctx.catalog.resolve(
        ResolveRequest(tenant_id=tenant, model=route.model, request_key=request_key, preview=preview)
    )
    fields = [
        dict(
            request_id=request_id if body.n == 1 else f"{request_id}.{i}",
            tenant_id=tenant,
            model=body.model,
            task=ask.task,
            metadata=body.metadata,
            route_facts=ask.carried,
            request_key=request_key,
            base_model=resolved.base_model,
            adapter=resolved.adapter,
            sampling=sampling[i],
            stream=body.stream,
            timeout_s=ctx.settings.request_timeout_s,
            priority=priority,
            **inputs,
        )
        for i in range(body.n)
    ]
    subs = await submit_all(ctx.nc, ctx.js, fields, ctx.settings.accept_timeout_s, preview)
    headers = _served_headers(request_id, subs)
    log.info(
        "request_accepted",
        request_id=request_id,
        tenant_id=tenant,
        model=body.model,
        task=route.task,
        rule=route.rule,
        experiment=route.experiment,
        arm=route.arm,
        n=body.n,
        workers=[s.accepted.worker_id for s in subs],
    )
    echo = body.prompt if isinstance(body, CompletionRequest) and body.echo else ""
    tools = inputs.get("tools")
    calls = tools is not None and tools.choice != "none"  # replies are parsed for tool calls
    scores_only = isinstance(body, CompletionRequest) and body.scores_only
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo_logprobs = sampling[0].prompt_logprobs is not None
        writer = ChunkWriter(
            chat, request_id, body.model, include_usage, echo, echo_logprobs=echo_logprobs, tools=calls
        )
        return StreamingResponse(_sse(subs, writer, scores_only), media_type="text/event-stream", headers=headers)
    want_logprobs = sampling[0].logprobs
    finals: dict[int, ReplyFinal] = {}
    logprobs: dict[int, list[TokenLogprob]] = {i: [] for i in range(body.n)}
    prompts: dict[int, list[TokenLogprob]] = {}
    async for index, event in merged(subs):
        if isinstance(event, ReplyFinal):
            finals[index] = _scored(event) if scores_only else event
        elif isinstance(event, ReplyPromptLogprobs):
            prompts.setdefault(index, []).extend(event.entries)
        elif event.logprobs is not None and not scores_only:
            logprobs[index].extend(event.logprobs)
    choices = [Choice(finals[i], logprobs[i] if want_logprobs else None, echo, tools=calls) for i in sorted(finals)]
    for i, choice in enumerate(choices):
        choice.prompt_logprobs = prompts.get(i) if want_logprobs else None
    return JSONResponse(full_response(chat, request_id, body.model, choices), headers=headers)


def _served_headers(request_id: str, subs: list[Submission]) -> dict[str, str]:
    """The served-by headers; no cache-hit header where a worker did not tell (an adapter the tenant
    does not own, whose residency other tenants' traffic keeps up)."""
    adapter = subs[0].request.adapter
    headers = {
        "x-lorafleet-request-id": request_id,
        "x-lorafleet-adapter": adapter.adapter_id if adapter else "",
        "x-lorafleet-version": str(adapter.version) if adapter else "",
        "x-lorafleet-worker": ",".join(sorted({s.accepted.worker_id for s in subs})),
    }
    hits = [s.accepted.cache_hit for s in subs]
    if None not in hits:
        headers["x-lorafleet-cache-hit"] = "true" if all(hits) else "false"
    return headers


def _scored(final: ReplyFinal) -> ReplyFinal:
    """A scoring request's final (``max_tokens`` 0): the one token generated is not part of the answer."""
    if final.finish_reason == "cancelled":
        return final
    usage = final.usage.model_copy(update={"completion_tokens": 0})
    return final.model_copy(update={"text": "", "finish_reason": "length", "usage": usage})


async def _sse(subs: list[Submission], writer: ChunkWriter, scores_only: bool = False) -> AsyncIterator[str]:
    """Stream chunks; a client that goes away cancels every choice on its worker (merged closes them)."""
    yield writer.start(len(subs))
    finals: dict[int, ReplyFinal] = {}
    prompts: dict[int, list[TokenLogprob]] = {}
    try:
        async for index, event in merged(subs):
            if isinstance(event, ReplyFinal):
                finals[index] = _scored(event) if scores_only else event
                yield writer.finish(index, finals[index])
            elif isinstance(event, ReplyPromptLogprobs):
                entries = prompts.setdefault(index, [])
                entries.extend(event.entries)
                if len(entries) == event.total:  # the whole prompt: its echo chunk
                    yield writer.echoed(index, entries)
            elif (event.text or event.logprobs) and not scores_only:
                yield writer.token(index, event.text, event.logprobs)
        yield writer.done([finals[i] for i in sorted(finals)])
    except LorafleetError as e:
        yield writer.error(error_payload(e))


def _message(m: ChatMessageIn) -> ChatMessage:
    role = "system" if m.role == "developer" else m.role
    return ChatMessage(role=role, content=m.text(), name=m.name, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id)


def _answered_calls(messages: list[ChatMessage]) -> None:
    """Each tool message answers a call of an assistant message before it (as OpenAI checks)."""
    called: set[str] = set()
    for m in messages:
        called.update(c.id for c in m.tool_calls or ())
        if m.tool_call_id is not None and m.tool_call_id not in called:
            raise InvalidRequest(
                f"the tool message for {m.tool_call_id!r} answers no tool call of an earlier assistant message",
                param="messages",
            )


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={**SSE_RESPONSE, **error_responses(*INFERENCE_ERRORS)},
)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, caller: Principal = Depends(inference_caller)
):
    """OpenAI chat completions; ``model`` is an adapter id or alias, ``alias@version``, or the base model."""
    ctx = _ctx(request)
    messages = [_message(m) for m in body.messages]
    if sum(len(m.content) for m in messages) > ctx.settings.max_prompt_chars:
        raise InvalidRequest(f"messages exceed {ctx.settings.max_prompt_chars} characters", param="messages")
    _answered_calls(messages)
    inputs = {"messages": messages, "tools": body.tool_spec(ctx.settings)}
    priority = _priority(request, body)
    ask = route_ask(ctx, caller, request.headers, body.model, body.metadata)
    return await _answer(request, _run(ctx, caller.tenant_id, body, inputs, "admin" in caller.scopes, priority, ask))


@router.post(
    "/v1/completions", response_model=Completion, responses={**SSE_RESPONSE, **error_responses(*INFERENCE_ERRORS)}
)
async def completions(body: CompletionRequest, request: Request, caller: Principal = Depends(inference_caller)):
    """OpenAI (legacy) text completions on the same models."""
    ctx = _ctx(request)
    if len(body.prompt) > ctx.settings.max_prompt_chars:
        raise InvalidRequest(f"prompt exceeds {ctx.settings.max_prompt_chars} characters", param="prompt")
    ask = route_ask(ctx, caller, request.headers, body.model, body.metadata)
    admin = "admin" in caller.scopes
    run = _run(ctx, caller.tenant_id, body, {"prompt": body.prompt}, admin, _priority(request, body), ask)
    return await _answer(request, run)


async def _models(ctx: GatewayContext, tenant: str) -> ListModelsReply:
    """The registry's list, then the tenant's task routes as ``task:<name>`` models."""
    reply = await bus_request(
        ctx.nc,
        subjects.registry("list"),
        ListModelsRequest(tenant_id=tenant),
        ListModelsReply,
        ctx.settings.registry_timeout_s,
    )
    table = ctx.catalog.routes.task_table(tenant)
    tasks = [
        ModelInfo(id=f"{TASK_PREFIX}{task}", owned_by=tenant, created=int(table.updated_at), kind="task")
        for task in sorted(table.routes)
    ]
    return ListModelsReply(models=[*reply.models, *tasks])


def _model_object(model: ModelInfo, model_id: str | None = None) -> dict:
    return {"id": model_id or model.id, "object": "model", "created": model.created, "owned_by": model.owned_by}


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401, 403, 503, 504))
async def list_models(request: Request, caller: Principal = Depends(inference_caller)) -> dict:
    """The base model, the released adapters this tenant may use, and its task routes (``task:<name>``)."""
    reply = await _models(_ctx(request), caller.tenant_id)
    return {"object": "list", "data": [_model_object(m) for m in reply.models]}


@router.get("/v1/models/{model}", response_model=Model, responses=error_responses(400, 401, 403, 404, 503, 504))
async def retrieve_model(model: str, request: Request, caller: Principal = Depends(inference_caller)) -> dict:
    """One model this tenant may call: the base model, an adapter id or alias, or ``alias@version``.
    A foreign or unknown adapter is the same 404 as on the inference routes (and is audited)."""
    ctx = _ctx(request)
    if len(model) > MODEL_NAME_MAX:  # the inference routes' own bound on ``model``
        raise InvalidRequest(f"model: at most {MODEL_NAME_MAX} characters", param="model")
    if model.startswith(TASK_PREFIX):  # a task route: listed, or the same 404 as on the inference routes
        listed = {m.id: m for m in (await _models(ctx, caller.tenant_id)).models}
        if model not in listed:
            table = ctx.catalog.routes.task_table(caller.tenant_id)
            visible = [name for name in listed if not name.startswith(TASK_PREFIX)]
            raise task_not_found(model.removeprefix(TASK_PREFIX), table.routes, visible)
        return _model_object(listed[model])
    key = f"retrieve:{hashlib.sha256(model.encode()).hexdigest()}"  # bounded whatever the name's length
    resolved = await ctx.catalog.resolve(ResolveRequest(tenant_id=caller.tenant_id, model=model, request_key=key))
    listed = {m.id: m for m in (await _models(ctx, caller.tenant_id)).models}
    entry = listed.get(model) or listed.get(resolved.adapter.adapter_id if resolved.adapter else resolved.base_model)
    if entry is None:  # released a moment ago, or retired since the resolve
        raise ModelNotFound(f"The model '{model}' does not exist or you do not have access to it.", param="model")
    return _model_object(entry, model)
