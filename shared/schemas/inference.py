"""Inference: a request, its dispatch, and what flows back on its reply inbox."""

import re
import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from shared.schemas.base import ErrorBody, Identifier, Message, RequestId, SloClass

# ---- inference ---------------------------------------------------------------------------


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class ToolCallFunction(Message):
    name: ToolName
    arguments: str = Field(max_length=200_000, description="the arguments as a JSON object text")


class ToolCall(Message):
    """One call an assistant message made (OpenAI's ``tool_calls`` entry)."""

    id: str = Field(min_length=1, max_length=64)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Message):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=200_000)
    name: str | None = Field(
        default=None, max_length=64, description="the participant's name, where the template renders it"
    )
    tool_calls: list[ToolCall] | None = Field(
        default=None, min_length=1, max_length=128, description="an assistant's calls"
    )
    tool_call_id: str | None = Field(
        default=None, min_length=1, max_length=64, description="a tool message: the call it answers"
    )

    @model_validator(mode="after")
    def _tool_fields(self) -> "ChatMessage":
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only one, has a tool_call_id")
        return self


class ToolFunction(Message):
    """A function the model may call: ``parameters`` is the JSON schema of its arguments."""

    name: ToolName
    description: str | None = Field(default=None, max_length=8192)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tools(Message):
    """The tools of a chat request, and how the model may use them (OpenAI's ``tool_choice``):
    ``none`` never calls, ``auto`` may call, ``required`` calls at least one, ``function`` calls
    ``function_name``; ``parallel``: more than one call in a reply."""

    functions: list[ToolFunction] = Field(min_length=1, max_length=128)
    choice: Literal["none", "auto", "required", "function"] = "auto"
    function_name: ToolName | None = None
    parallel: bool = True

    @model_validator(mode="after")
    def _named(self) -> "Tools":
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        if (self.choice == "function") != (self.function_name is not None):
            raise ValueError("function_name is given exactly when choice is function")
        if self.function_name is not None and self.function_name not in names:
            raise ValueError(f"tool_choice names {self.function_name!r}, which is not among the tools")
        return self


class StructuredOutput(Message):
    """Output constrained during decoding: any JSON object, JSON valid under ``json_schema``, or
    xgrammar's structural tag (free text and tagged JSON segments: tool calls)."""

    kind: Literal["json_object", "json_schema", "structural_tag"]
    json_schema: str | None = Field(default=None, max_length=200_000, description="the schema as a JSON text")
    structural_tag: str | None = Field(default=None, max_length=400_000, description="the tag as a JSON text")

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "StructuredOutput":
        if (self.kind == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when kind is json_schema")
        if (self.kind == "structural_tag") != (self.structural_tag is not None):
            raise ValueError("structural_tag is given exactly when kind is structural_tag")
        return self


class SamplingParams(Message):
    max_tokens: int = Field(default=128, ge=1, le=32_768)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1000, description="0 disables top-k")
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=8)
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="minus this once a token has appeared")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="minus this per earlier occurrence")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=10.0, description="divides positive, multiplies negative logits of seen tokens"
    )
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the top probability")
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=300
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=64)
    logprobs: bool = Field(default=False, description="return each output token's logprob")
    top_logprobs: int = Field(default=0, ge=0, le=20, description="and this many most likely alternatives")
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="return each prompt token's logprob and this many alternatives; None: not asked",
    )
    structured: StructuredOutput | None = None


class ResolvedAdapter(Message):
    """The exact adapter version a request was granted by the registry."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    rank: int = Field(ge=1, le=1024)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    storage_uri: str = Field(max_length=2048)
    alpha: float = Field(gt=0)
    use_rslora: bool = False
    target_modules: list[str] = Field(
        default_factory=list, max_length=10, description="the modules it adapts; empty: not known (any engine)"
    )


TASK_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"  # a task type as a route names it
HEADER_PATTERN = r"^x-[a-z0-9-]{1,62}$"  # a header a routing rule may match: lower case, ``x-`` only
META_KEY_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_METADATA = 16
_META_KEY = re.compile(META_KEY_PATTERN)
_HEADER = re.compile(HEADER_PATTERN)


def check_metadata(metadata: dict[str, str]) -> None:
    """Request metadata (and a rule's match on it): at most 16 pairs, keys of ``META_KEY_PATTERN``, values 1-512 chars."""
    if len(metadata) > MAX_METADATA:
        raise ValueError(f"metadata holds at most {MAX_METADATA} pairs")
    for key, value in metadata.items():
        if not _META_KEY.fullmatch(key) or not 0 < len(value) <= 512:
            raise ValueError(f"metadata {key[:80]!r}: keys match {META_KEY_PATTERN}, values are 1-512 characters")


class RouteFacts(Message):
    """What a policy may match beyond the tenant and the request: set by the gateway from the caller's
    key and headers (the scheduler trusts it only on the gateway's subjects, and clears it on a
    tenant's own)."""

    key_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    headers: dict[str, str] = Field(default_factory=dict, max_length=16)

    @model_validator(mode="after")
    def _bounded(self) -> "RouteFacts":
        for name, value in self.headers.items():
            if not _HEADER.fullmatch(name) or not 0 < len(value) <= 256:
                raise ValueError(f"header {name[:80]!r}: names match {HEADER_PATTERN}, values at most 256 chars")
        return self


class InferRequest(Message):
    """One generation request, as submitted on ``lf.infer.submit.<tenant>``."""

    request_id: RequestId
    tenant_id: Identifier
    model: str = Field(
        min_length=1, max_length=256, description="the name the client asked for; the scheduler resolves it"
    )
    request_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="what a canary split hashes (the OpenAI ``user``); None = the request id",
    )
    base_model: str = Field(min_length=1, max_length=256)
    adapter: ResolvedAdapter | None = Field(
        default=None, description="optional for a client: if given, it must be what the scheduler resolves"
    )
    messages: list[ChatMessage] | None = Field(default=None, max_length=1024)
    tools: Tools | None = Field(default=None, description="a chat's tools: rendered by the template, calls constrained")
    prompt: str | None = Field(default=None, max_length=400_000)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    stream: bool = False
    reply_to: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^_INBOX[._][A-Za-z0-9_.-]+$",
        description="the requester's inbox: _INBOX.<id> (gateway) or _INBOX_<tenant>.<id> (direct tenant clients)",
    )
    priority: SloClass | None = Field(
        default=None,
        description="the request's SLO class, at most its tenant's tier; None = the tier (the scheduler sets it)",
    )
    ttft_target_s: float | None = Field(
        default=None,
        gt=0,
        le=86400,
        description="the class's time-to-first-token target (set by the scheduler from its config, never the client's)",
    )
    created_at: float = Field(
        default_factory=time.time, description="epoch seconds; the scheduler overwrites it with its admission time"
    )
    timeout_s: float = Field(default=120.0, gt=0, le=3600)
    tenant_gpu_slots: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="the tenant's GPU adapter slot quota per rank class (set by the scheduler from its limits)",
    )
    tenant_slot_enforce: Literal["soft", "hard"] = Field(
        default="soft",
        description="how the worker holds the tenant to tenant_gpu_slots (set by the scheduler from its limits)",
    )
    preview: bool = Field(
        default=False,
        description="a pinned staging version may be served: set by the scheduler from the submission's "
        "subject (the gateway's preview subject), never taken from the client",
    )
    accept_deadline: float | None = Field(
        default=None, description="epoch seconds after which the client no longer waits for a worker"
    )
    task: str | None = Field(
        default=None,
        pattern=TASK_PATTERN,
        description="the task the request names (with ``model`` ``auto``); the scheduler sets the task it was routed by",
    )
    experiment: str | None = Field(
        default=None, pattern=TASK_PATTERN, description="the experiment it was assigned by: set by the scheduler only"
    )
    arm: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,32}$", description="the experiment's arm")
    metadata: dict[str, str] = Field(
        default_factory=dict, description="the request's metadata (routing policies match it)"
    )
    route_facts: RouteFacts | None = Field(
        default=None,
        description="the caller's key and headers, as the gateway saw them (cleared on a tenant's own subject)",
    )
    compare_tokens: int | None = Field(
        default=None,
        ge=1,
        le=32_768,
        description="the worker digests this many first output tokens into the audit record (a run compared in "
        "the shadow): set by the scheduler, never taken from the client",
    )
    shadow_of: RequestId | None = Field(
        default=None,
        description="the production request this run shadows (the scheduler's own submission, never a client's)",
    )

    @model_validator(mode="after")
    def _one_input(self) -> "InferRequest":
        check_metadata(self.metadata)
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("exactly one of messages or prompt must be given")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools come with messages")
        if self.tools is not None and self.tools.choice != "none" and self.sampling.structured is not None:
            raise ValueError("tools (unless tool choice is none) and a structured output constraint are exclusive")
        return self


class DispatchReply(Message):
    """A worker's answer to ``lf.worker.<id>.dispatch``: it took the request, or why not."""

    accepted: bool
    worker_id: Identifier
    error: ErrorBody | None = None


class ServedBy(Message):
    worker_id: Identifier
    base_model: str
    adapter_id: str | None = None
    adapter_version: int | None = None
    adapter_digest: str | None = None
    cache_hit: bool | None = Field(
        default=True, description="as on ReplyAccepted: None when the adapter is not the requester's own"
    )


class Usage(Message):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)


class ReplyAccepted(Message):
    kind: Literal["accepted"] = "accepted"
    request_id: RequestId
    worker_id: Identifier
    cache_hit: bool | None = Field(
        description="the adapter (or base model) was resident when the worker accepted; None (not told) for an "
        "adapter the requester does not own: a shared adapter's residency tells of other tenants' traffic"
    )


class TopLogprob(Message):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Message):
    """One token's logprob under the model (before any sampling transform), OpenAI's shape."""

    token: str
    logprob: float | None = Field(description="None for a prompt's first token, which nothing predicts")
    bytes: list[int]
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ReplyToken(Message):
    kind: Literal["token"] = "token"
    request_id: RequestId
    index: int = Field(ge=0)
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = Field(default=None, description="one per token id, when asked for")


class ReplyPromptLogprobs(Message):
    """A piece of the prompt's logprobs (``SamplingParams.prompt_logprobs``): the pieces come in order,
    before the first token, each within the bus's payload limit; together one entry per prompt token,
    the first with logprob None."""

    kind: Literal["prompt_logprobs"] = "prompt_logprobs"
    request_id: RequestId
    start: int = Field(ge=0, description="the prompt position of this piece's first entry")
    total: int = Field(ge=1, description="the prompt's token count: the last piece ends there")
    entries: list[TokenLogprob] = Field(min_length=1)

    @model_validator(mode="after")
    def _within_the_prompt(self) -> "ReplyPromptLogprobs":
        if self.start + len(self.entries) > self.total:
            raise ValueError("the piece runs past the prompt's token count")
        return self


class ReplyFinal(Message):
    kind: Literal["final"] = "final"
    request_id: RequestId
    text: str
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage
    served_by: ServedBy
    ttft_ms: float = Field(ge=0)
    tpot_ms: float = Field(ge=0)


class ReplyError(Message):
    kind: Literal["error"] = "error"
    request_id: RequestId
    error: ErrorBody


ReplyMessage = Annotated[
    ReplyAccepted | ReplyPromptLogprobs | ReplyToken | ReplyFinal | ReplyError, Field(discriminator="kind")
]


class ReplyEnvelope(Message):
    """What travels on a request's reply inbox; one wrapper so a consumer decodes one type."""

    body: ReplyMessage
