"""Structured outputs: JSON grammars compiled with xgrammar, one matcher per constrained sequence,
and the per-step token bitmask that keeps each constrained row inside its grammar."""

import asyncio
import hashlib
import threading
import time
from collections import Counter, OrderedDict

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from services.worker.engine.sequence import Sequence
from services.worker.engine.upload import upload
from services.worker.grammar_pool import CompilePool
from shared import metrics
from shared.config import GrammarBounds
from shared.errors import GrammarCompilesBusy, GrammarTooComplex, InvalidRequest
from shared.schemas import StructuredOutput

# a tenant's cache entry: the compiled grammar, or the typed refusal a retry gets at once
_Entry = xgr.CompiledGrammar | InvalidRequest


def digest(spec: StructuredOutput) -> str:
    text = spec.structural_tag if spec.kind == "structural_tag" else spec.json_schema
    return hashlib.sha256(f"{spec.kind}\x00{text or ''}".encode()).hexdigest()


class Grammars:
    """Compiles (in a bounded process pool, cached per tenant by schema digest, thread-safe) and
    masks; one per engine. A tenant's grammars are its own: never served to another tenant, and a
    tenant evicts another's only while it holds more than its share."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_ids: set[int],
        max_rows: int,
        capacity: int,
        bounds: GrammarBounds | None = None,
    ):
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_ids) or None  # None: xgrammar reads them from the tokenizer
        self._pool: CompilePool | None = None  # built with the first grammar; its children start on first use
        self._vocab_size = vocab_size
        self._bounds = bounds or GrammarBounds()
        self._lock = threading.Lock()
        self._cache: dict[str, OrderedDict[str, _Entry]] = {}  # tenant -> digest -> entry, oldest first
        self._size = 0
        self._capacity = capacity
        self._turns: dict[str, asyncio.Semaphore] = {}  # tenant -> its concurrent compiles (event loop only)
        self._waiting: Counter[str] = Counter()  # tenant -> its compiles running or waiting for a turn
        self._bitmask = xgr.allocate_token_bitmask(max_rows, vocab_size)  # [max_rows, ceil(vocab / 32)] int32

    def _pool_once(self) -> CompilePool:
        with self._lock:
            if self._pool is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._pool = CompilePool(info, self._bounds)
            return self._pool

    def cached(self, spec: StructuredOutput, tenant: str) -> xgr.CompiledGrammar | None:
        """The tenant's compiled grammar of ``spec`` if cached; raises the refusal cached for it."""
        with self._lock:
            entries = self._cache.get(tenant)
            entry = entries.get(digest(spec)) if entries is not None else None
            if entry is None:
                return None
            assert entries is not None
            entries.move_to_end(digest(spec))
        if isinstance(entry, InvalidRequest):
            metrics.GRAMMAR_COMPILES.labels("refused_again").inc()
            raise type(entry)(entry.message, param=entry.param)
        return entry

    def compile(self, spec: StructuredOutput, tenant: str = "", queued_at: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec`` for ``tenant``; blocks up to the compile bound. Raises
        InvalidSchema (xgrammar refuses it), GrammarTooComplex (past the bound) or GrammarCompilesBusy."""
        cached = self.cached(spec, tenant)
        if cached is not None:
            return cached
        try:
            grammar = self._pool_once().compile(spec, queued_at)
        except GrammarCompilesBusy:
            metrics.GRAMMAR_COMPILES.labels("busy").inc()
            raise
        except InvalidRequest as refusal:  # refused again at once, without another compile
            metrics.GRAMMAR_COMPILES.labels(
                "too_complex" if isinstance(refusal, GrammarTooComplex) else "invalid"
            ).inc()
            self._remember(tenant, digest(spec), refusal)
            raise
        metrics.GRAMMAR_COMPILES.labels("compiled").inc()
        self._remember(tenant, digest(spec), grammar)
        return grammar

    async def prepare(self, spec: StructuredOutput, tenant: str) -> xgr.CompiledGrammar:
        """Compile ``spec`` for ``tenant`` off the caller's event loop, at most ``tenant_compiles`` of the
        tenant's at once; a compile that waits past the bound for its turn is GrammarCompilesBusy. A
        cancelled request's compile keeps its tenant's turn until it ends: a tenant cannot free its turns
        by hanging up, while its compiles still hold the children."""
        cached = self.cached(spec, tenant)
        if cached is not None:
            return cached
        queued_at = time.monotonic()
        turn = self._turns.setdefault(tenant, asyncio.Semaphore(self._bounds.tenant_compiles))
        self._waiting[tenant] += 1
        try:
            await asyncio.wait_for(turn.acquire(), self._bounds.compile_timeout_s)
        except BaseException as e:
            self._leave(tenant)
            if not isinstance(e, TimeoutError):
                raise
            metrics.GRAMMAR_COMPILES.labels("busy").inc()
            raise GrammarCompilesBusy(
                f"this tenant already runs {self._bounds.tenant_compiles} grammar compile(s) on the worker: "
                "retry shortly",
                retry_after_s=self._bounds.compile_timeout_s,
            ) from None
        compiling = asyncio.ensure_future(asyncio.to_thread(self.compile, spec, tenant, queued_at))
        compiling.add_done_callback(lambda done: self._compiled(tenant, turn, done))
        return await asyncio.shield(compiling)

    def _compiled(self, tenant: str, turn: asyncio.Semaphore, done: asyncio.Future[xgr.CompiledGrammar]) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: the request that awaited it may be gone
        turn.release()
        self._leave(tenant)

    def _leave(self, tenant: str) -> None:
        self._waiting[tenant] -= 1
        if not self._waiting[tenant]:
            del self._waiting[tenant], self._turns[tenant]

    def _remember(self, tenant: str, key: str, entry: _Entry) -> None:
        with self._lock:
            entries = self._cache.setdefault(tenant, OrderedDict())
            self._size += key not in entries
            entries[key] = entry
            entries.move_to_end(key)
            while len(entries) > self._bounds.tenant_cache_share:
                entries.popitem(last=False)
                self._size -= 1
            while self._size > self._capacity:  # the largest holder gives up its oldest
                largest = max(self._cache.values(), key=len)
                largest.popitem(last=False)
                self._size -= 1
            for name in [name for name, held in self._cache.items() if not held]:
                del self._cache[name]

    def matcher(
        self, spec: StructuredOutput, tenant: str = "", compiled: xgr.CompiledGrammar | None = None
    ) -> xgr.GrammarMatcher:
        """A matcher of ``compiled`` (compiled off the step loop), else of ``spec`` compiled now."""
        return xgr.GrammarMatcher(compiled if compiled is not None else self.compile(spec, tenant))

    def compile_pids(self) -> list[int]:
        """The compile processes running now (none before the first grammar)."""
        return self._pool.pids() if self._pool is not None else []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

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
