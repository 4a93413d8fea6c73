"""A prompt's token ids in the base model's vocabulary, chat template included, without transformers.

Reads the model directory's ``tokenizer.json`` with the Rust ``tokenizers`` library and renders the
chat template (``chat_template.jinja`` or ``tokenizer_config.json``) in a sandboxed jinja2
environment set up as transformers sets up its own (same options, filters and globals), then
encodes the text without adding special tokens, as ``apply_chat_template`` does. About 0.1 ms
for a short chat, against ~0.8 ms through transformers. The gateway counts prompts with it; the
worker tokenises with it once it has checked it agrees with transformers on its model.
"""

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from shared import tool_calls
from shared.errors import InvalidRequest
from shared.schemas import ChatMessage, Tools

SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict[str, str]) -> None:
        self._tokenizer = tokenizer
        self._template = _environment().from_string(chat_template) if chat_template else None
        self.renders_tools = tool_calls.template_renders_tools(chat_template)
        self._special = special

    @classmethod
    def load(cls, model_dir: Path) -> "ChatTokenizer":
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        special = {name: _token_text(config.get(name)) for name in SPECIAL}
        template_file = model_dir / "chat_template.jinja"  # newer transformers save the template beside the config
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        return cls(Tokenizer.from_file(str(model_dir / "tokenizer.json")), template, special)

    def encode(self, messages: list[ChatMessage] | None, prompt: str | None, tools: Tools | None = None) -> list[int]:
        """The ids of a chat (rendered with the generation prompt and its tools) or of a plain
        prompt (with the special tokens, a BOS, the tokenizer adds to a text, as transformers'
        ``tokenizer(text)``)."""
        if messages is None:
            return self._tokenizer.encode(prompt or "", add_special_tokens=True).ids
        text = self.render(messages, tools)
        if any(m.name is not None for m in messages) and text == self.render(
            [m.model_copy(update={"name": None}) for m in messages], tools
        ):
            raise name_dropped()
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def render(self, messages: list[ChatMessage], tools: Tools | None = None) -> str:
        if self._template is None:
            raise InvalidRequest("this model has no chat template: send a prompt to /v1/completions", param="messages")
        chat, listed = template_inputs(self.renders_tools, messages, tools)
        try:
            return self._template.render(
                messages=chat,
                tools=listed,
                documents=None,
                add_generation_prompt=True,
                **self._special,
            )
        except TemplateError as e:
            raise InvalidRequest(f"the chat template refused these messages: {e}", param="messages") from None


def template_inputs(
    renders_tools: bool, messages: list[ChatMessage], tools: Tools | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The ``messages`` and ``tools`` a chat template is rendered with: a template that renders
    tool calls in lorafleet's format gets them as they are; another one the Hermes layout of
    ``shared.tool_calls`` (only where the chat has tools, calls or tool results)."""
    if renders_tools:
        return tool_calls.template_messages(messages), tool_calls.openai_tools(tools)
    if tools is None and all(m.tool_calls is None and m.role != "tool" for m in messages):
        return [m.model_dump(exclude_none=True) for m in messages], None
    return tool_calls.hermes_messages(messages, tools), None


def name_dropped() -> InvalidRequest:
    """The refusal of a ``name`` the chat template would drop (it is honoured or refused, never lost)."""
    return InvalidRequest(
        "this model's chat template does not render a message's name: send the messages without one",
        param="messages",
    )
