"""The bounds every inference request is held to, wherever it enters: the gateway checks an HTTP
body against ``RequestBounds``, the scheduler checks a direct-NATS submission against the same
settings with ``check_submission``, so a tenant gains nothing by skipping the gateway."""

from shared.config import RequestBounds
from shared.errors import InvalidRequest, PayloadTooLarge
from shared.prompt_tokens import PromptTokens
from shared.schema_bounds import check_schema_shape, parse_schema_text
from shared.schemas import InferRequest


def prompt_chars(request: InferRequest) -> int:
    return len(request.prompt or "") + sum(len(m.content) for m in request.messages or ())


async def check_submission(
    request: InferRequest, size: int, bounds: RequestBounds, tokens: PromptTokens | None
) -> None:
    """Raise the gateway's typed error for the first bound ``request`` (``size`` bytes as
    submitted) exceeds; ``tokens`` None counts the prompt in characters only, as the gateway does."""
    if size > bounds.max_body_bytes:
        raise PayloadTooLarge(f"request body exceeds {bounds.max_body_bytes} bytes")
    max_tokens = request.sampling.max_tokens
    if max_tokens > bounds.max_tokens_limit:
        raise InvalidRequest(
            f"max_tokens {max_tokens} exceeds the limit of {bounds.max_tokens_limit}", param="max_tokens"
        )
    stops = len(request.sampling.stop)
    if stops > bounds.max_stop:
        raise InvalidRequest(f"{stops} stop sequences exceed the limit of {bounds.max_stop}", param="stop")
    check_schemas(request, bounds)
    param = "messages" if request.messages is not None else "prompt"
    if prompt_chars(request) > bounds.max_prompt_chars:
        raise InvalidRequest(f"{param} exceed {bounds.max_prompt_chars} characters", param=param)
    if tokens is None or bounds.max_prompt_tokens == 0:
        return
    count = await tokens.count(request.messages, request.prompt, request.tools)
    if count > bounds.max_prompt_tokens:
        raise InvalidRequest(
            f"the prompt has {count} tokens, over the limit of {bounds.max_prompt_tokens}", param=param
        )


def check_schemas(request: InferRequest, bounds: RequestBounds) -> None:
    """The request's JSON schemas (its structured output's, its tools' parameters) within the shape bounds."""
    depth, values = bounds.max_schema_depth, bounds.max_schema_values
    structured = request.sampling.structured
    if structured is not None and structured.json_schema is not None:
        parse_schema_text(structured.json_schema, depth, values, "response_format")
    for function in request.tools.functions if request.tools is not None else ():
        check_schema_shape(function.parameters, depth, values, "tools")
