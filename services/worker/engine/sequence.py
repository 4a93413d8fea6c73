"""A request as the engine sees it, and the per-step output it yields."""

import enum
import hashlib
import time
from array import array
from dataclasses import dataclass, field

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from services.worker.engine.detokenizer import IncrementalDetokenizer
from shared.schemas import SamplingParams, SloClass, TokenLogprob, slo_rank


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation: prompt ids (chat template already applied) and how to sample."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    logprobs: bool = False
    # Who may share this request's cached prompt K/V: only requests with the same salt and adapter
    # (the worker passes tenant and adapter digest, so no tenant can time another's prompts).
    cache_salt: str | None = None
    # the tenant (the worker passes it): whose compiled grammars it uses and whose compile turns it waits
    # for, and whose share of the KV blocks it counts toward (EngineConfig.tenant_kv_share); None: nobody's
    tenant: str | None = None
    # its structured output's grammar, compiled off the step loop (AsyncEngine.generate); None: the engine
    # compiles it when the request is added (direct LLMEngine callers)
    grammar: xgr.CompiledGrammar | None = None
    # the SLO class it is admitted by (services/worker/engine/batch_scheduler.py): interactive first
    slo_class: SloClass = "standard"
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request; ``text`` is a delta that never splits a character."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    first_token_time: float | None  # time.monotonic() of the first output token
    logprobs: list[float] | None = None
    token_logprobs: list[TokenLogprob] | None = None  # OpenAI's entries, one per token id, when asked
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, on the first output, when asked
    # engine seconds the request consumed so far: its share of each step by the tokens it fed the step
    # (services/worker/engine/engine.py step_shares); None where the engine does not measure it (vLLM)
    engine_s: float | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output), KV block table and decoding state of one request."""

    def __init__(self, request: EngineRequest, tokenizer: PreTrainedTokenizerBase):
        self.request = request
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached = 0
        self.num_registered = 0  # leading blocks of block_table published to the prefix cache
        self._block_hashes: list[bytes] = []
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.rank = slo_rank(request.slo_class)  # 0 = interactive, the highest class
        self.waiting_since = 0  # the scheduler step it last joined the waiting queue at
        self.slot = -1
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.token_ids, request.sampling.stop)
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        self.engine_s = 0.0  # its shares of the steps it ran in (RequestOutput.engine_s)
        seed = request.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.matcher: xgr.GrammarMatcher | None = None  # set by the engine for a structured request

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its first prefill must compute every prompt position's logits (none from the prefix cache)."""
        return self.request.sampling.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def num_new_tokens(self) -> int:
        """Tokens this sequence feeds to the next forward pass: all of them on (re)prefill, else one."""
        return self.num_tokens - self.num_cached

    def block_hashes(self, count: int, block_size: int) -> list[bytes]:
        """Content digests of the first ``count`` full blocks, each chained to the one before it.

        A digest names the block's tokens, every token before them, the adapter and the cache
        salt: two blocks share K/V only when all four match. SHA-256, so a collision (which would
        serve one request another's K/V) is not a practical concern."""
        hashes = self._block_hashes
        if not hashes and count:
            # The salt and adapter are hashed on their own first, so every block hashes a fixed
            # 32-byte parent then its tokens: no string can pass for token bytes or the reverse.
            root = hashlib.sha256(f"{self.request.cache_salt or ''}\x00{self.request.adapter or ''}".encode())
            hashes.append(hashlib.sha256(root.digest() + self._block_bytes(0, block_size)).digest())
        while len(hashes) < count:
            hashes.append(hashlib.sha256(hashes[-1] + self._block_bytes(len(hashes), block_size)).digest())
        return hashes[:count]

    def _block_bytes(self, index: int, block_size: int) -> bytes:
        return array("q", self.token_ids[index * block_size : (index + 1) * block_size]).tobytes()

    def preempt(self) -> None:
        """Drop cached KV; the sequence re-prefills its prompt and output so far when readmitted."""
        self.num_cached = 0
        self.num_registered = 0
        self.status = Status.WAITING
