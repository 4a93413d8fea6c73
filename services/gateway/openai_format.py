"""Shape engine replies as OpenAI responses and SSE chunks (one or several choices)."""

import json
import time
from dataclasses import dataclass, field

from shared import tool_calls
from shared.schemas import ReplyFinal, TokenLogprob, ToolCall


@dataclass(slots=True)
class Choice:
    """One choice as the gateway relays it: the final reply, and the token logprobs if asked for."""

    final: ReplyFinal
    logprobs: list[TokenLogprob] | None = None
    prefix: str = ""  # the echoed prompt (completions echo)
    tools: bool = False  # the reply's text holds tool calls to parse (a chat with tools)
    prompt_logprobs: list[TokenLogprob] | None = None  # the echoed prompt's entries (echo with logprobs)


@dataclass(slots=True)
class Offsets:
    """Character offset of the next token in a completions choice's text (``text_offset``)."""

    at: int = 0
    seen: list[int] = field(default_factory=list)


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {"content": [entry.model_dump() for entry in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offsets: Offsets) -> dict:
    """The legacy completions shape: parallel lists, ``top_logprobs`` a dict per token that holds
    the chosen token and its alternatives (as vLLM returns it)."""
    text_offset = []
    for entry in entries:
        text_offset.append(offsets.at)
        offsets.at += len(bytes(entry.bytes).decode(errors="ignore"))
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{e.token: e.logprob, **{t.token: t.logprob for t in e.top_logprobs}} for e in entries],
        "text_offset": text_offset,
    }


def echo_logprobs(entries: list[TokenLogprob], prompt: str) -> dict:
    """The echoed prompt's entries in the completions shape, offsets counted from 0 across the
    prompt. Nothing predicts the first token: its logprob and alternatives are null; when the
    tokenizer added it (a BOS, not part of the prompt's text) it takes no width."""
    shaped = completion_logprobs(entries, Offsets())
    if entries:
        shaped["top_logprobs"][0] = None
        first = shaped["text_offset"][1] if len(entries) > 1 else 0
        if not prompt.startswith(entries[0].token):
            shaped["text_offset"] = [0] + [offset - first for offset in shaped["text_offset"][1:]]
    return shaped


def _choice_logprobs(chat: bool, choice: Choice) -> dict | None:
    if choice.logprobs is None:
        return None
    if chat:
        return chat_logprobs(choice.logprobs)
    shaped = completion_logprobs(choice.logprobs, Offsets(at=len(choice.prefix)))
    if choice.prompt_logprobs is None:
        return shaped
    echoed = echo_logprobs(choice.prompt_logprobs, choice.prefix)
    return {key: echoed[key] + shaped[key] for key in shaped}


def usage(finals: list[ReplyFinal]) -> dict:
    """The request's usage: the prompt is counted once, completions of every choice are summed."""
    prompt = finals[0].usage.prompt_tokens if finals else 0
    completion = sum(f.usage.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_id(chat: bool, request_id: str) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def call_entry(call: ToolCall, index: int | None = None) -> dict:
    """A call as OpenAI writes it in a message (no index) or a stream delta (its index)."""
    entry = {"id": call.id, "type": "function", "function": call.function.model_dump()}
    return entry if index is None else {"index": index, **entry}


def finish_reason(final: ReplyFinal, calls: int) -> str:
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason


def _choice(chat: bool, index: int, choice: Choice) -> dict:
    final = choice.final
    logprobs = _choice_logprobs(chat, choice)
    if chat:
        message: dict = {"role": "assistant", "content": final.text}
        calls: list[ToolCall] = []
        if choice.tools:
            message["content"], calls = tool_calls.parse(final.text)
            if calls:
                message["tool_calls"] = [call_entry(c) for c in calls]
        return {
            "index": index,
            "message": message,
            "finish_reason": finish_reason(final, len(calls)),
            "logprobs": logprobs,
        }
    return {
        "index": index,
        "text": choice.prefix + final.text,
        "finish_reason": final.finish_reason,
        "logprobs": logprobs,
    }


def full_response(chat: bool, request_id: str, model: str, choices: list[Choice]) -> dict:
    return {
        "id": completion_id(chat, request_id),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(chat, i, c) for i, c in enumerate(choices)],
        "usage": usage([c.final for c in choices]),
    }


class ChunkWriter:
    """Writes the SSE ``data:`` lines of one streamed response."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        include_usage: bool,
        echo: str = "",
        echo_logprobs: bool = False,
        tools: bool = False,
    ):
        self.chat = chat
        self.echo = echo
        self.echo_logprobs = echo_logprobs  # the echo chunk waits for the prompt's entries (``echoed``)
        self.tools = tools
        self._parsers: dict[int, tool_calls.ToolCallParser] = {}
        self._offsets: dict[int, Offsets] = {}
        self.id = completion_id(chat, request_id)
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"

    def _line(self, choices: list[dict], **extra: object) -> str:
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        if self.include_usage and "usage" not in extra:
            body["usage"] = None  # OpenAI sends an explicit null on every chunk but the last
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None,
        role: bool = False,
        logprobs: list[TokenLogprob] | None = None,
    ) -> dict:
        if not self.chat:
            offsets = self._offsets.setdefault(index, Offsets(at=len(self.echo)))
            shaped = None if logprobs is None else completion_logprobs(logprobs, offsets)
            return {"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": shaped}
        delta: dict = {"role": "assistant", "content": ""} if role else {}
        if text is not None and not role:
            delta["content"] = text
        shaped = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": shaped}

    def start(self, n: int) -> str:
        if self.chat:
            return "".join(self._line([self._choice(i, "", None, role=True)]) for i in range(n))
        if not self.echo or self.echo_logprobs:
            return ""
        return "".join(self._line([self._choice(i, self.echo, None)]) for i in range(n))

    def echoed(self, index: int, entries: list[TokenLogprob]) -> str:
        """The echo chunk of a choice whose prompt logprobs were asked for, carrying them."""
        shaped = echo_logprobs(entries, self.echo)
        return self._line([{"index": index, "text": self.echo, "finish_reason": None, "logprobs": shaped}])

    def token(self, index: int, text: str, logprobs: list[TokenLogprob] | None = None) -> str:
        if self.chat and self.tools:
            return self._segments(index, self._parser(index).feed(text), logprobs)
        return self._line([self._choice(index, text, None, logprobs=logprobs)])

    def finish(self, index: int, final: ReplyFinal) -> str:
        if self.chat and self.tools:
            parser = self._parser(index)
            rest = self._segments(index, parser.finish(), None)
            return rest + self._line([self._choice(index, None, finish_reason(final, len(parser.calls)))])
        return self._line([self._choice(index, None if self.chat else "", final.finish_reason)])

    def _parser(self, index: int) -> tool_calls.ToolCallParser:
        return self._parsers.setdefault(index, tool_calls.ToolCallParser())

    def _segments(self, index: int, segments: list[tool_calls.Segment], logprobs: list[TokenLogprob] | None) -> str:
        """One chunk of what a piece of a chat reply with tools gave: content, whole calls, or
        (text held back while it may be a call's tag) only its logprobs."""
        content = "".join(s.content for s in segments)
        calls = [s.call for s in segments if s.call is not None]
        if not content and not calls and logprobs is None:
            return ""
        choice = self._choice(index, content if content else None, None, logprobs=logprobs)
        if calls:
            first = len(self._parser(index).calls) - len(calls)
            choice["delta"]["tool_calls"] = [call_entry(c, first + i) for i, c in enumerate(calls)]
        return self._line([choice])

    def done(self, finals: list[ReplyFinal]) -> str:
        out = self._line([], usage=usage(finals)) if self.include_usage else ""
        return out + "data: [DONE]\n\n"

    @staticmethod
    def error(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
