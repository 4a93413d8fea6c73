"""Response models for the OpenAPI document: OpenAI's response shapes and its error JSON."""

from typing import Any, Literal

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CalledFunction(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[MessageToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls", "cancelled"]
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length", "cancelled"]
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


_MEANING = {
    400: "invalid request: malformed body, unsupported parameter, or a bound exceeded",
    401: "missing, unknown or revoked API key",
    403: "the API key lacks the scope this route needs, or asks for a priority above its tenant's tier",
    404: "unknown model or object, or one this tenant may not see (same answer for both)",
    409: "conflicts with the current state",
    410: "the adapter version was revoked",
    413: "request body too large",
    429: "over the tenant's quota, or the fleet cannot serve the request's SLO class in time; see Retry-After",
    503: "no worker, scheduler or registry available",
    504: "the request exceeded its time bound",
}
INFERENCE_ERRORS = (400, 401, 403, 404, 410, 413, 429, 503, 504)
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "string",
                    "description": "with stream=true: OpenAI chunk objects as `data:` lines, then `data: [DONE]`",
                }
            }
        }
    }
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries, each an OpenAI error JSON."""
    return {s: {"model": ErrorResponse, "description": _MEANING[s]} for s in statuses}
