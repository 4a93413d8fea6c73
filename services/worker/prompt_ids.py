"""A request's prompt -> token ids for the engine.

``shared.chat_tokens`` renders and encodes a chat in ~0.1 ms where transformers'
``apply_chat_template`` takes ~0.8 ms, on the request's path to its first token. The worker uses it
only once it has produced exactly transformers' ids for the model's tokenizer on a set of probe
prompts (roles, multi-turn, non-ASCII, special-token text, whitespace); a model whose template or
tokenizer it does not reproduce keeps transformers' path.
"""

from pathlib import Path
from typing import Any, cast

import structlog
from transformers import PreTrainedTokenizerBase

from shared.chat_tokens import ChatTokenizer, name_dropped, template_inputs
from shared.errors import InvalidRequest
from shared.schemas import ChatMessage, Tools
from shared.tool_calls import template_renders_tools

log = structlog.get_logger("worker.prompts")

PROBE_CHATS = [
    [ChatMessage(role="user", content="What is the capital of France?")],
    [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="héllo  wörld\n\ttabs"),
        ChatMessage(role="assistant", content="Hi!"),
        ChatMessage(role="user", content="emoji 🦊 and <|im_end|>"),
    ],
    [ChatMessage(role="user", content="  leading and trailing  \n\n")],
]
PROBE_PROMPTS = ["The capital of France is", "  spaces and ünïcode 🦊 </s> <|endoftext|>", "a\n\nb\r\nc"]


class PromptIds:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, fast: ChatTokenizer | None = None) -> None:
        self._tokenizer = tokenizer
        self.fast = fast

    @classmethod
    def for_model(cls, tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> "PromptIds":
        """The fast path if it reproduces transformers on this model, else transformers alone."""
        slow = cls(tokenizer)
        try:
            fast = ChatTokenizer.load(model_dir)
            agrees = all(fast.encode(chat, None) == slow.encode(chat, None) for chat in PROBE_CHATS) and all(
                fast.encode(None, p) == slow.encode(None, p) for p in PROBE_PROMPTS
            )
        except Exception as e:  # no tokenizer.json, a template jinja2 alone cannot render, ...
            log.warning("fast_tokenizer_unavailable", error=f"{type(e).__name__}: {e}")
            return slow
        if not agrees:
            log.warning("fast_tokenizer_disagrees", detail="tokenising with transformers")
            return slow
        return cls(tokenizer, fast)

    def encode(self, messages: list[ChatMessage] | None, prompt: str | None, tools: Tools | None = None) -> list[int]:
        if self.fast is not None:
            ids = self.fast.encode(messages, prompt, tools)
        elif messages is not None:
            if any(m.name is not None for m in messages) and self._render(messages, tools, False) == self._render(
                [m.model_copy(update={"name": None}) for m in messages], tools, False
            ):
                raise name_dropped()
            ids = cast(list[int], self._render(messages, tools, True))
        else:
            ids = self._tokenizer(prompt, add_special_tokens=True)["input_ids"]  # a BOS where the tokenizer adds one
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenisation", param="prompt")
        return list(ids)

    def _render(self, messages: list[ChatMessage], tools: Tools | None, tokenize: bool) -> str | list[int]:
        # transformers types every form of the result at once; one chat without a dict is a str,
        # or tokenized a flat list of ids
        template = self._tokenizer.chat_template
        chat, listed = template_inputs(
            template_renders_tools(template if isinstance(template, str) else None), messages, tools
        )
        return cast(
            str | list[int],
            self._tokenizer.apply_chat_template(
                chat,
                tools=list[Any](listed) if listed is not None else None,
                add_generation_prompt=True,
                tokenize=tokenize,
                return_dict=False,
            ),
        )
