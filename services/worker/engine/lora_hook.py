"""The contract between the engine and the adapter slot cache (implemented in the worker's LoRA package)."""

from dataclasses import dataclass
from typing import Protocol

import torch

# The forward pass's fused projections: each group's members read the same input, and its output holds
# their outputs side by side in this order (q | k | v, gate | up).
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# A mixture-of-experts layer's routed experts, the same way: each token-expert pair's rows.
EXPERT_GROUPS: dict[str, tuple[str, ...]] = {
    "gate_up": ("experts.gate_proj", "experts.up_proj"),
    "down": ("experts.down_proj",),
}


@dataclass(frozen=True, slots=True)
class BgmvCalls:
    """LoRA deltas as ``DecoderStack.forward`` takes them (kernels/csrc/decoder_stack.cpp): per call,
    ``layout`` holds its group's index in GROUPS, its member count and their columns, and ``tensors``
    its scales, token indices and token rows, then every layer's A of each member (layer-major), then
    as many B."""

    tensors: list[torch.Tensor]
    layout: list[int]


class LoraHook(Protocol):
    """Per-step LoRA state; the forward pass calls it after each base projection group."""

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += delta(x) for each token's own adapter and each of the group's projections it targets,
        each into its own columns of y, in place.

        group: a key of GROUPS; x: [num_tokens, in_features]; y: [num_tokens, the group's summed
        out_features], the group's fused output; tokens in the step's flattened order.
        """
        ...

    def apply_experts(
        self, layer: int, group: str, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, y: torch.Tensor
    ) -> None:
        """The routed experts' form of ``apply``: row p of x is token ``tokens[p]``'s input to expert
        ``experts[p]``, and y[p] += delta(x[p]) of that token's adapter for that expert, in place.

        group: a key of EXPERT_GROUPS; x: [pairs, in]; tokens, experts: int64 [pairs]; y: [pairs, the
        group's summed out_features]."""
        ...

    @property
    def expert_groups(self) -> frozenset[str]:
        """The EXPERT_GROUPS any of this step's tokens' adapters target (``apply_experts`` is called for these)."""
        ...

    @property
    def ranks(self) -> tuple[int, ...]:
        """The rank classes this step's tokens read, ascending (what ``engine_step_time_ms`` is labelled by)."""
        ...

    @property
    def groups(self) -> frozenset[str]:
        """The groups holding a projection any of this step's tokens' adapters target: the forward pass
        calls ``apply`` for these only (a q,v adapter's step makes one call per layer, for "qkv")."""
        ...

    def bgmv_calls(self, dtype: torch.dtype) -> BgmvCalls | None:
        """The step's deltas as kernels.native ``lora_bgmv`` calls for the native layer loop (every
        layer's, in ``apply``'s order), or None where some of them take another path (the loop then
        runs in Python and calls ``apply``). ``dtype``: the model's."""
        ...


class GraphLoraHook(LoraHook, Protocol):
    """A LoraHook of fixed shapes for the CUDA-graph decode step: ``stage`` writes a step's rows into
    static buffers, and ``apply`` reads the first ``counts[c]`` rows of each rank class c."""

    counts: tuple[int, ...]  # per rank class, the rows the forward reads (set before a forward or capture)

    def key(self, token_slots: list[int], bucket: int) -> tuple[int, ...]:
        """Per rank class, the bucketed count of the step's tokens in it (0 where none)."""
        ...

    def stage(self, token_slots: list[int], counts: tuple[int, ...]) -> None:
        """Write the step's adapter tokens (token_slots: one per row, -1 = base) for the key ``counts``."""
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

    def graph_hook(self, max_rows: int) -> GraphLoraHook:
        """The CUDA-graph decode step's static hook over steps of up to ``max_rows`` rows."""
        ...
