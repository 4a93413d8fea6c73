"""A request as the engine sees it, and the per-step output it yields."""

import enum
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from services.worker.engine.detokenizer import IncrementalDetokenizer
from shared.schemas import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One generation: prompt ids (chat template already applied) and how to sample."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None
    logprobs: bool = False
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
        self.block_table: list[int] = []
        self.status = Status.WAITING
        self.slot = -1
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.token_ids, request.sampling.stop)
        self.first_token_time: float | None = None
        self.finish_reason: str | None = None
        seed = request.sampling.seed
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

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
    def num_new_tokens(self) -> int:
        """Tokens this sequence feeds to the next forward pass: all of them on (re)prefill, else one."""
        return self.num_tokens - self.num_cached

    def preempt(self) -> None:
        """Drop cached KV; the sequence re-prefills its prompt and output so far when readmitted."""
        self.num_cached = 0
        self.status = Status.WAITING
