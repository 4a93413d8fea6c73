"""Paged KV cache: fixed-size blocks, a free-list allocator and per-sequence block tables."""

from collections import OrderedDict
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
    """Reference-counted KV blocks, some holding reusable prompt K/V (the prefix cache).

    Free blocks with no reusable content form a stack: last freed, first reused, each sequence's
    blocks handed back in their table order, so the blocks in use stay the fewest and the most
    recently touched ones (block tables stay in order, the working set in the CPU caches). A freed
    block whose content is published under a digest stays findable until it is needed: it is taken
    only when the stack is empty, the least recently freed first, a sequence's tail before its head.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # the next block is the last entry
        self._refs = [0] * num_blocks
        self._digest_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks with content, oldest first

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose K/V is published for reuse (in use or not)."""
        return len(self._block_of)

    def can_allocate(self, count: int) -> bool:
        return count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise RuntimeError(f"KV cache exhausted: {count} blocks asked, {self.num_free} free")
        return [self._take() for _ in range(count)]

    def _take(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._digest_of.pop(block)]
        self._refs[block] = 1
        return block

    def free(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def lookup(self, digest: bytes) -> int | None:
        return self._block_of.get(digest)

    def is_referenced(self, block: int) -> bool:
        return self._refs[block] > 0

    def holders(self, block: int) -> int:
        """How many sequences read ``block``."""
        return self._refs[block]

    def share(self, block: int) -> None:
        """One more sequence reads ``block`` (found by ``lookup``)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def publish(self, block: int, digest: bytes) -> bool:
        """Make ``block`` findable under ``digest``; False if that content already has a block."""
        if digest in self._block_of or block in self._digest_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        return True

    def unpublish(self, blocks: list[int]) -> None:
        """Their content can no longer be trusted (the step that was to write it failed)."""
        for block in blocks:
            digest = self._digest_of.pop(block, None)
            if digest is not None:
                del self._block_of[digest]
                if block in self._evictable:
                    del self._evictable[block]
                    self._free.append(block)

    def clear_cache(self) -> None:
        """Forget every published block; unreferenced ones become plain free blocks."""
        self.unpublish(list(self._digest_of))


class BlockManager:
    """Grows, shares and releases the block tables of sequences.

    With prefix caching, a sequence's full blocks are published as soon as the step that
    computes them is scheduled: a later admission with the same salt, adapter and leading
    tokens takes them instead of recomputing, even in that same step (each layer writes every
    token's K/V before any token attends). At least the last prompt token is always computed,
    in a block of the sequence's own, so shared blocks are never written again.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self.queried_tokens = 0  # prompt tokens looked up at admission
        self.hit_tokens = 0  # of which found in the prefix cache
        self._published: list[int] = []  # blocks published since the last commit

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hits(self, seq: "Sequence") -> list[int]:
        """The leading blocks of ``seq`` already in the cache (never its last token's block); none for a
        prefill that reports prompt logprobs, which needs every prompt position's logits."""
        if not self.prefix_caching or seq.wants_prompt_logprobs:
            return []
        hits = []
        for digest in seq.block_hashes((seq.num_tokens - 1) // self.block_size, self.block_size):
            block = self.allocator.lookup(digest)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: "Sequence") -> bool:
        return self.shortfall(seq) <= 0

    def shortfall(self, seq: "Sequence") -> int:
        """Blocks the admission of ``seq`` lacks now (zero or less when it fits)."""
        hits = self._hits(seq)
        idle_hits = sum(not self.allocator.is_referenced(b) for b in hits)  # sharing takes them off the free count
        return self.blocks_needed(seq.num_tokens) - len(hits) - (self.allocator.num_free - idle_hits)

    def freeable(self, seq: "Sequence") -> int:
        """Blocks that freeing ``seq`` would return to the allocator (those no other sequence reads)."""
        return sum(self.allocator.holders(block) == 1 for block in seq.block_table)

    def growth(self, seq: "Sequence") -> int:
        """Blocks the next ``append`` of ``seq`` takes: 1 when its newest token starts a block, else 0."""
        return self._missing(seq)

    def allocate(self, seq: "Sequence") -> None:
        """Blocks for every token of ``seq`` (a prefill, or a recompute after preemption); cached
        leading blocks are shared and ``seq.num_cached`` set past them."""
        hits = self._hits(seq)
        for block in hits:
            self.allocator.share(block)
        seq.block_table = hits + self.allocator.allocate(self.blocks_needed(seq.num_tokens) - len(hits))
        seq.num_cached = len(hits) * self.block_size
        seq.num_registered = len(hits)
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += seq.num_cached
        self.publish(seq)

    def can_append(self, seq: "Sequence") -> bool:
        return self._missing(seq) == 0 or self.allocator.can_allocate(1)

    def append(self, seq: "Sequence") -> None:
        """Make room for the KV of ``seq``'s newest token."""
        if self._missing(seq):
            seq.block_table.extend(self.allocator.allocate(1))
        self.publish(seq)

    def publish(self, seq: "Sequence") -> None:
        """Publish ``seq``'s blocks that are full once this step has written its tokens."""
        full = seq.num_tokens // self.block_size
        if not self.prefix_caching or seq.num_registered >= full:
            return
        digests = seq.block_hashes(full, self.block_size)
        for index in range(seq.num_registered, full):
            block = seq.block_table[index]
            if self.allocator.publish(block, digests[index]):
                self._published.append(block)
        seq.num_registered = full

    def commit(self) -> None:
        """The step ran: what it published holds the K/V it names."""
        self._published.clear()

    def rollback(self) -> None:
        """The step failed: unpublish what it was to write."""
        self.allocator.unpublish(self._published)
        self._published.clear()

    def free(self, seq: "Sequence") -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_registered = 0

    def _missing(self, seq: "Sequence") -> int:
        return max(0, self.blocks_needed(seq.num_tokens) - len(seq.block_table))
