"""Paged KV cache: fixed-size blocks, a free-list allocator and per-sequence block tables."""

from typing import TYPE_CHECKING

import torch

from services.worker.engine.weights import ModelSpec

if TYPE_CHECKING:
    from services.worker.engine.sequence import Sequence


def blocks_for_budget(spec: ModelSpec, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks of ``block_size`` tokens (every layer, K and V) fit in ``budget_bytes``."""
    return budget_bytes // (spec.kv_bytes_per_token(dtype) * block_size)


class KVCache:
    """K and V of every layer, as [num_layers, 2, kv_heads, num_blocks * block_size, head_dim].

    Slot ``b * block_size + i`` holds token ``i`` of block ``b``. Zero-initialised so padded
    reads past a sequence's length are finite and vanish under the attention mask.
    """

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: str):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (spec.num_layers, 2, spec.num_kv_heads, num_blocks * block_size, spec.head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def layer(self, index: int) -> torch.Tensor:
        """K and V of one layer: [2, kv_heads, num_slots, head_dim]."""
        return self.data[index]


class BlockAllocator:
    """Free list of block ids; allocation never exceeds the cache.

    Last freed, first reused (a stack), each sequence's blocks handed back in their table order:
    the blocks in use stay the fewest and the most recently touched ones, so a long-running worker
    keeps its block tables in order (its decode gathers read memory in sequence), its working set
    in the CPU caches, and its resident memory at the peak of what was in use, where a queue would
    cycle through every block of the budget and scatter the tables over all of it."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # the next block is the last entry

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise RuntimeError(f"KV cache exhausted: {count} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class BlockManager:
    """Grows and releases the block tables of sequences."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: "Sequence") -> bool:
        return self.allocator.can_allocate(self.blocks_needed(seq.num_tokens))

    def allocate(self, seq: "Sequence") -> None:
        """Blocks for every token of ``seq`` (a prefill, or a recompute after preemption)."""
        seq.block_table = self.allocator.allocate(self.blocks_needed(seq.num_tokens))

    def can_append(self, seq: "Sequence") -> bool:
        return self._missing(seq) == 0 or self.allocator.can_allocate(1)

    def append(self, seq: "Sequence") -> None:
        """Make room for the KV of ``seq``'s newest token."""
        if self._missing(seq):
            seq.block_table.extend(self.allocator.allocate(1))

    def free(self, seq: "Sequence") -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []

    def _missing(self, seq: "Sequence") -> int:
        return max(0, self.blocks_needed(seq.num_tokens) - len(seq.block_table))
