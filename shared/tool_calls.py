"""Tool calls in the Hermes / Qwen format, the one lorafleet serves:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The worker constrains a reply's calls to this shape with xgrammar's ``qwen_3`` structural tag (the
function's name, then arguments valid under its JSON schema); the gateway turns the reply's text
back into OpenAI ``tool_calls`` with ``ToolCallParser``, streamed or not, the same way in both.

A chat template that renders tools in this format itself (Qwen2.5, Qwen3, Hermes, ...) gets the
tools and the calls as transformers passes them (``tools=``, ``tool_calls`` with the arguments as
a dict, ``tool`` messages). Any other template gets them through ``hermes_messages``: the tools
and the format's instructions in the system message, an assistant's calls as the tagged text it
would have produced, and tool results as a user turn of ``<tool_response>`` blocks — the same
layout Qwen's templates produce, so what the model sees and what it must write agree.
"""

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from shared.schemas import ChatMessage, ToolCall, ToolCallFunction, Tools

BEGIN = "<tool_call>"
END = "</tool_call>"
NAME_PREFIX = '<tool_call>\n{"name": "'  # what xgrammar's qwen_3 tag writes before a name
ARGUMENTS_PREFIX = '", "arguments": '
CALL_END = "}\n</tool_call>"

INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template renders tools and calls in this format itself."""
    return template is not None and "tools" in template and BEGIN in template


def openai_tools(tools: Tools | None) -> list[dict[str, Any]] | None:
    """The tools as transformers' templates take them (OpenAI's shape); None when the model is not
    to see them (no tools, or tool choice ``none``)."""
    if tools is None or tools.choice == "none":
        return None
    return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in tools.functions]


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # a client's own history: rendered as it was written


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as a tools-aware template reads them: calls' arguments as objects."""
    out = []
    for m in messages:
        entry = m.model_dump(exclude_none=True)
        if m.tool_calls is not None:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        out.append(entry)
    return out


def call_text(call: ToolCall) -> str:
    body = json.dumps(
        {"name": call.function.name, "arguments": _arguments(call.function.arguments)}, ensure_ascii=False
    )
    return f"{BEGIN}\n{body}\n{END}"


def hermes_messages(messages: list[ChatMessage], tools: Tools | None) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: the layout Qwen's templates render."""
    out: list[dict[str, Any]] = []
    listed = openai_tools(tools)
    if listed is not None:
        block = INSTRUCTIONS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in listed))
        if messages[0].role == "system":
            out.append({"role": "system", "content": f"{messages[0].content}\n\n{block}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m.role == "tool":
            response = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
            continue
        entry = m.model_dump(exclude_none=True, exclude={"tool_calls", "tool_call_id"})
        if m.tool_calls is not None:
            calls = "\n".join(call_text(c) for c in m.tool_calls)
            entry["content"] = f"{m.content}\n{calls}" if m.content else calls
        out.append(entry)
    for entry in out:
        entry.pop("tool_responses", None)
    return out


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class Segment:
    """A piece of a reply: content text, or one complete call."""

    content: str = ""
    call: ToolCall | None = None


def parse_call(body: str) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` as a call; None if the text is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"} or not isinstance(value["name"], str):
        return None
    if not isinstance(value["arguments"], dict):
        return None
    try:
        function = ToolCallFunction(name=value["name"], arguments=json.dumps(value["arguments"], ensure_ascii=False))
    except ValueError:
        return None
    return ToolCall(id=new_call_id(), function=function)


def _held(text: str) -> int:
    """The length of the longest end of ``text`` that could begin a call tag."""
    for n in range(min(len(text), len(BEGIN) - 1), 0, -1):
        if BEGIN.startswith(text[-n:]):
            return n
    return 0


@dataclass(slots=True)
class ToolCallParser:
    """Reply text in, content and calls out, incrementally: whatever the text's chunking, the
    content and calls are the same. Content is the text outside the call tags, without the
    whitespace at its ends or after a call; a tag that never closes (the reply hit its token
    limit) or does not hold a call stays content, as written."""

    _buffer: str = ""
    _in_call: bool = False
    _started: bool = False
    _pending_space: str = ""
    _strip_next: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[Segment]:
        self._buffer += text
        out: list[Segment] = []
        while True:
            if self._in_call:
                end = self._buffer.find(END)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(END) :]
                self._in_call = False
                call = parse_call(body)
                if call is None:
                    self._content(f"{BEGIN}{body}{END}", out)
                else:
                    self._strip_next = True
                    self.calls.append(call)
                    out.append(Segment(call=call))
                continue
            begin = self._buffer.find(BEGIN)
            if begin >= 0:
                self._content(self._buffer[:begin], out)
                self._buffer = self._buffer[begin + len(BEGIN) :]
                self._in_call = True
                continue
            keep = _held(self._buffer)
            ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep :]
            self._content(ready, out)
            return out

    def finish(self) -> list[Segment]:
        out: list[Segment] = []
        rest, self._buffer = (BEGIN if self._in_call else "") + self._buffer, ""
        self._in_call = False
        self._content(rest, out)
        return out

    def _content(self, text: str, out: list[Segment]) -> None:
        if not text.strip():
            if self._started and not self._strip_next:
                self._pending_space += text
            return
        core = text.rstrip()
        if not self._started:
            core = core.lstrip()
        elif self._strip_next:  # after a call: the space before it separates, the space after it goes
            core = self._pending_space + core.lstrip()
        else:
            core = self._pending_space + core
        self._started, self._strip_next = True, False
        self._pending_space = text[len(text.rstrip()) :]
        out.append(Segment(content=core))


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None if it has none) and calls."""
    parser = ToolCallParser()
    segments = parser.feed(text) + parser.finish()
    content = "".join(s.content for s in segments)
    return content or None, parser.calls
