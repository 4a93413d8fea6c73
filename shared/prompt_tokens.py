"""Count a prompt in the base model's tokens, the way the worker will (chat template included),
with ``shared.chat_tokens``: no transformers or torch import in the gateway process."""

import asyncio
from pathlib import Path

from shared.chat_tokens import ChatTokenizer
from shared.schemas import ChatMessage, Tools

INLINE_CHARS = 4096  # longer prompts are tokenised off the event loop


class PromptTokens:
    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def load(cls, model_dir: Path) -> "PromptTokens":
        return cls(ChatTokenizer.load(model_dir))

    def count_sync(self, messages: list[ChatMessage] | None, prompt: str | None, tools: Tools | None = None) -> int:
        return len(self._tokenizer.encode(messages, prompt, tools))

    async def count(self, messages: list[ChatMessage] | None, prompt: str | None, tools: Tools | None = None) -> int:
        size = (
            len(prompt or "")
            + sum(len(m.content) for m in messages or ())
            + (len(tools.functions) * 200 if tools else 0)
        )
        if size <= INLINE_CHARS:
            return self.count_sync(messages, prompt, tools)
        return await asyncio.to_thread(self.count_sync, messages, prompt, tools)
