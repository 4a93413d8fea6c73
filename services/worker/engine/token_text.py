"""A token id's text and bytes as OpenAI's logprobs report them."""

import re
from functools import lru_cache

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from shared.schemas import TokenLogprob, TopLogprob

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_BYTE_DECODER = {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]


class TokenText:
    """Token id -> (text, bytes); a token that is part of a UTF-8 character has text ``bytes:\\xNN...``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self.of = lru_cache(maxsize=65_536)(self._of)

    def _of(self, token_id: int) -> tuple[str, list[int]]:
        text = str(self._tokenizer.decode([token_id], skip_special_tokens=False))
        if "\ufffd" not in text:
            return text, list(text.encode())
        piece = str(self._tokenizer.convert_ids_to_tokens(token_id))
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback is not None:  # sentencepiece byte fallback
            raw = bytes([int(fallback.group(1), 16)])
        elif all(char in _BYTE_DECODER for char in piece):  # byte-level BPE
            raw = bytes(_BYTE_DECODER[char] for char in piece)
        else:
            return text, list(text.encode())
        try:
            return raw.decode(), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def entry(self, token_id: int, logprob: float, top_ids: list[int], top_logprobs: list[float]) -> TokenLogprob:
        text, raw = self.of(token_id)
        top = [
            TopLogprob(token=t, logprob=lp, bytes=b)
            for (t, b), lp in zip(map(self.of, top_ids), top_logprobs, strict=True)
        ]
        return TokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=top)
