"""Incremental detokenisation with stop strings: text deltas never split a character or leak a stop."""

from collections.abc import Callable
from typing import cast

from transformers import PreTrainedTokenizerBase

_WINDOW = 5


class IncrementalDetokenizer:
    """Turns each new token of ``token_ids`` (a list it shares with the sequence) into text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, token_ids: list[int], stop: list[str]):
        self._tokenizer = tokenizer
        self._ids = token_ids
        self._read = len(token_ids)
        self._prefix = max(0, self._read - _WINDOW)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._emitted = 0
        self.text = ""

    def update(self) -> bool:
        """Decode what the newest tokens completed; True when the text now contains a stop string."""
        # transformers types decode as str | list[str]; one flat list of ids decodes to one str
        decode = cast(Callable[..., str], self._tokenizer.decode)
        prefix_text = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        new_text = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        for stop in self._stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1:
                self.text = self.text[:index]
                return True
        return False

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, hold back what could still begin a stop string."""
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
