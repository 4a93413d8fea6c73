"""The contract between the engine and the adapter slot cache (implemented in the worker's LoRA package)."""

from typing import Protocol

import torch

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraHook(Protocol):
    """Per-step LoRA state; the forward pass calls it after each base projection."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += delta(x) for each token's own adapter, in place.

        x: [num_tokens, in_features]; y: [num_tokens, out_features], possibly a non-contiguous
        column view of a fused projection output; tokens in the step's flattened order.
        """
        ...

    @property
    def ranks(self) -> tuple[int, ...]:
        """The rank classes this step's tokens read, ascending (what ``engine_step_time_ms`` is labelled by)."""
        ...

    @property
    def modules(self) -> frozenset[str]:
        """The projections any of this step's tokens' adapters target: the forward pass calls ``apply`` for these
        only (a batch-1 decode step on a q,v adapter skips 150 calls and their slices on SmolLM2)."""
        ...


class LoraProvider(Protocol):
    """Maps adapter names to resident slots and builds each step's LoRA state."""

    def slot_of(self, adapter: str) -> int | None:
        """The adapter's slot, or None while it is not resident (its requests wait, others run)."""
        ...

    @property
    def rank_classes(self) -> tuple[int, ...]:
        """The slot pool's rank classes, ascending (the lowest is the rank-skew gauge's baseline)."""
        ...

    def prepare(self, token_slots: torch.Tensor) -> LoraHook | None:
        """token_slots: int64 [num_tokens] on the host, -1 = base model only. Called once per step with any slot >= 0."""
        ...
