"""The OpenAI request bodies the gateway accepts: anything unsupported is refused, never ignored."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

StopText = Annotated[str, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class ChatMessageIn(_Body):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict] = Field(description="text, or a list of text parts")
    name: str | None = Field(default=None, max_length=64)

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[dict]) -> str | list[dict]:
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
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content)


class _Sampling(_Body):
    model: str = Field(min_length=1, max_length=256)
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
    presence_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(default=0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    ignore_eos: bool = Field(default=False, description="lorafleet extension, for benchmarks")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False, le=False, description="not supported: must be false")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)
    echo: bool = Field(default=False, le=False, description="not supported: must be false")
    logprobs: int | None = Field(default=None, le=0, description="not supported")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
