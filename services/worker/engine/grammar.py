"""Structured outputs: JSON grammars compiled with xgrammar, one matcher per constrained sequence,
and the per-step token bitmask that keeps each constrained row inside its grammar."""

import hashlib
import threading
from collections import OrderedDict

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from services.worker.engine.sequence import Sequence
from services.worker.engine.upload import upload
from shared.errors import InvalidSchema
from shared.schemas import StructuredOutput

_ANY_OBJECT = '{"type": "object"}'


def digest(spec: StructuredOutput) -> str:
    text = spec.structural_tag if spec.kind == "structural_tag" else spec.json_schema
    return hashlib.sha256(f"{spec.kind}\x00{text or ''}".encode()).hexdigest()


class Grammars:
    """Compiles (cached by schema digest, thread-safe) and masks; one per engine."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: set[int], max_rows: int, capacity: int
    ):
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_ids) or None  # None: xgrammar reads them from the tokenizer
        self._compiler: xgr.GrammarCompiler | None = None  # built with the first grammar (~0.2 s)
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._capacity = capacity
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)  # [max_rows, ceil(vocab / 32)] int32

    def _compiler_once(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; raises InvalidSchema for a schema xgrammar cannot compile."""
        key = digest(spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        compiler = self._compiler_once()
        try:
            # compact JSON: a small model cannot wander off into unbounded whitespace
            if spec.structural_tag is not None:  # tool calls (services/worker/tool_grammar.py)
                grammar = compiler.compile_structural_tag(spec.structural_tag)
            elif spec.json_schema is None:  # JSON mode: any object
                grammar = compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            else:
                grammar = compiler.compile_json_schema(spec.json_schema, any_whitespace=False)
        except (RuntimeError, ValueError) as e:
            what, param = ("tools", "tools") if spec.structural_tag is not None else ("JSON schema", "response_format")
            raise InvalidSchema(f"the {what} cannot be enforced: {_reason(e)}", param=param) from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutput) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compile(spec))

    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """logits: [num_seqs, vocab] fp32, in place: each constrained row's forbidden tokens -> -inf."""
        rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        for row in rows:
            matcher = seqs[row].matcher
            assert matcher is not None
            matcher.fill_next_token_bitmask(self._bitmask, row)
        if rows:
            bitmask = upload(self._bitmask[: len(seqs)], logits.device)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=rows)


def _reason(error: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(error).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
