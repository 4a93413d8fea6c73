"""The OpenAI request bodies the gateway accepts: anything unsupported is refused, never ignored."""

import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.config import RequestBounds
from shared.errors import InvalidSchema
from shared.schema_bounds import check_schema_shape
from shared.schemas import SloClass, StructuredOutput, ToolCall, ToolFunction, Tools, check_metadata

StopText = Annotated[str, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer: OpenAI's newer name for system instructions, rendered as system"
    )
    content: str | list[dict] | None = Field(
        default=None, description="text, or a list of text parts; null only for an assistant's tool calls"
    )
    name: str | None = Field(default=None, max_length=64, description="refused (400) where the chat template drops it")
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1, max_length=128, description="an assistant's")
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=64, description="a tool message's call")
    # what the openai client sends back when a response's message is appended as it came: empty only
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ChatMessageIn":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only on an assistant message with tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message has a tool_call_id, and no other message does")
        return self

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict] | None) -> str | list[dict] | None:
        if v is None:
            return v
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
        for text in [v] if isinstance(v, str) else [part["text"] for part in v]:
            try:  # plain str fields refuse lone surrogates themselves; this union does not
                text.encode()
            except UnicodeEncodeError:
                raise ValueError("text must be valid Unicode (a lone surrogate is not)") from None
        return v

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)


class FunctionIn(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=8192)
    parameters: dict[str, Any] | None = Field(default=None, description="the arguments' JSON schema")
    strict: bool | None = Field(default=None, description="arguments are always decoded under the schema")


class ToolIn(_Body):
    type: Literal["function"]
    function: FunctionIn


class FunctionName(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is json_schema")
        return self

    def structured(self, bounds: RequestBounds) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.json_schema is None:
            return StructuredOutput(kind="json_object")
        return StructuredOutput(kind="json_schema", json_schema=checked_schema(self.json_schema.schema_, bounds))


def checked_schema(schema: dict[str, Any], bounds: RequestBounds, param: str = "response_format") -> str:
    """The schema as canonical JSON text (one digest per schema), or a typed 400: SchemaTooLarge past
    the depth and size bounds (checked first, without recursion), InvalidSchema if it is not a valid
    JSON Schema (checked here against the 2020-12 meta-schema; the worker's grammar compiler refuses
    the rest with the same error, or GrammarTooComplex past its time bound)."""
    check_schema_shape(schema, bounds.max_schema_depth, bounds.max_schema_values, param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidSchema(f"not a valid JSON schema: {e.message}", param=param) from None
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


class _Sampling(_Body):
    model: str = Field(
        default="auto",
        min_length=1,
        max_length=256,
        description="an adapter id or alias, alias@version, the base model, task:<name>, or auto (omitted) "
        "with the x-lorafleet-task header",
    )
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] = Field(
        default_factory=dict, max_length=16, description="request metadata (routing policies may match it)"
    )
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1000, description="lorafleet extension; 0 disables")
    n: int = Field(default=1, ge=1, le=128, description="choices to generate; bounded by the gateway's max_n")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=16)] | None = Field(
        default=None, description="stop sequences; how many is bounded by the gateway's max_stop"
    )
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="lorafleet extension (as vLLM)")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="lorafleet extension (as vLLM)")
    logit_bias: (
        dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100, le=100)]] | None
    ) = Field(default=None, max_length=300, description="token id -> bias added to its logit")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, max_length=64, description="lorafleet extension (as vLLM): token ids that end the output"
    )
    ignore_eos: bool = Field(default=False, description="lorafleet extension, for benchmarks")
    priority: SloClass | None = Field(
        default=None,
        description="lorafleet extension (or the x-lorafleet-priority header): the request's SLO class, at most "
        "the tenant's tier (above it: 403 priority_not_allowed); unset = the tier",
    )

    def bias(self) -> dict[int, float]:
        return {int(token): value for token, value in (self.logit_bias or {}).items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, metadata: dict[str, str]) -> dict[str, str]:
        check_metadata(metadata)
        return metadata


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="needs logprobs: true")
    response_format: ResponseFormat | None = None
    tools: list[ToolIn] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tools(self) -> "ChatCompletionRequest":
        if self.tools is None:
            if self.tool_choice is not None or self.parallel_tool_calls is not None:
                raise ValueError("tool_choice and parallel_tool_calls need tools")
            return self
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        constrained = self.response_format is not None and self.response_format.type != "text"
        if constrained and self.tool_choice != "none":
            raise ValueError("response_format together with tools is not supported (unless tool_choice is none)")
        return self

    def tool_spec(self, bounds: RequestBounds) -> Tools | None:
        """The tools as the worker takes them, each function's parameters checked as a JSON schema."""
        if self.tools is None:
            return None
        functions = []
        for tool in self.tools:
            parameters = tool.function.parameters
            if parameters is None:
                parameters = {"type": "object", "properties": {}}
            checked_schema(parameters, bounds, param="tools")
            functions.append(
                ToolFunction(name=tool.function.name, description=tool.function.description, parameters=parameters)
            )
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            return Tools(functions=functions, choice="function", function_name=choice.function.name, parallel=False)
        return Tools(functions=functions, choice=choice, parallel=self.parallel_tool_calls is not False)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0

    def structured(self, bounds: RequestBounds) -> StructuredOutput | None:
        return self.response_format.structured(bounds) if self.response_format is not None else None


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0, description="0 (with echo): score the prompt only")
    echo: bool = Field(
        default=False, description="the prompt is prepended to each choice's text (with logprobs: and its logprobs)"
    )
    logprobs: int | None = Field(default=None, ge=0, le=20, description="this many alternatives per token (0: none)")

    @model_validator(mode="after")
    def _nothing_to_return(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (it returns the prompt only)")
        return self

    @property
    def scores_only(self) -> bool:
        """OpenAI's scoring idiom: the echoed prompt (and its logprobs), nothing generated."""
        return self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.scores_only else self.max_tokens  # the one token generated is not returned

    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def requested_logprobs(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def structured(self, bounds: RequestBounds) -> StructuredOutput | None:
        return None
