"""CUDA graphs of the decode step: one graph per batch-size bucket, replayed over static input buffers.

A decode-only step of ``n`` sequences is padded to the smallest bucket ``>= n`` (``bucket_for``);
a step larger than the largest bucket runs eagerly. The padding rows write their K/V to a scratch
KV block that no sequence owns (the engine reserves it past the allocator's blocks) and attend to
its first slot alone (length 1), so their softmax stays finite; their logits are dropped.

What a graph captures is ``DecodeGraphs._forward``: every tensor it reads is a static buffer, filled
before a replay by one host -> device copy, or is derived from them inside the captured region (the
token fields, the decode mask and its biases, built before the first layer rather than on its first
use, and the gathered K/V), so a replay recomputes it. Its shapes depend on the bucket alone: the
paged attention gathers a fixed ``ceil(max_model_len / block_size)`` blocks per row, the padding
of a block table pointing at the scratch block. The price is attention over ``max_model_len``
columns per row whatever the sequences' lengths; the gain, one launch for the whole step.

LoRA: a step with adapter tokens runs eagerly. Its metadata (token order, segments, per-class
index lists) is built on the host with data-dependent shapes, which a fixed-shape BGMV over the
bucket could replace; until then graphs serve base-model decodes. Prefill and mixed steps always
run eagerly.

With ``capture=False`` the same ``_forward`` runs without capture: the path the CPU tests compare
with the eager step, on any device.
"""

import bisect

import torch

from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.model import LlamaForward
from services.worker.engine.sequence import Sequence

MAX_GRAPH_BATCH = 512  # vLLM's default largest capture: beyond it, replay saves little over the step's work
FIELDS = 4  # per row: input id, position, cache slot, context length; then the block table


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets as vLLM captures them: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs``
    (itself the last bucket, capped at MAX_GRAPH_BATCH)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    largest = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [size for size in (1, 2, 4) if size < largest] + list(range(8, largest, 8)) + [largest]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``n`` sequences; None above the largest (run eagerly)."""
    if n < 1:
        raise ValueError(f"a decode step has at least one sequence, got {n}")
    index = bisect.bisect_left(sizes, n)
    return sizes[index] if index < len(sizes) else None


class DecodeGraphs:
    """Static decode buffers at the largest bucket, and on CUDA one captured graph per bucket."""

    def __init__(
        self,
        model: LlamaForward,
        cache: KVCache,
        scratch_block: int,
        max_model_len: int,
        sizes: list[int],
        capture: bool = True,
    ):
        if not 0 <= scratch_block < cache.num_blocks:
            raise ValueError(f"scratch block {scratch_block} is not in the cache's {cache.num_blocks} blocks")
        self.model = model
        self.cache = cache
        self.sizes = sizes
        self.scratch_block = scratch_block
        self.width = -(-max_model_len // cache.block_size)  # blocks per row, whatever the row's length
        device = cache.data.device
        self._static = torch.zeros(sizes[-1], FIELDS + self.width, dtype=torch.int64, device=device)
        self._columns = torch.arange(self.width * cache.block_size, device=device)  # [width * block_size]
        self._windows = sorted({p.window for p in model.attention if p.window is not None})
        self._padding = [0, 0, scratch_block * cache.block_size, 1] + [scratch_block] * self.width
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's logits [bucket, vocab]
        if capture:
            self._capture()

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def fits(self, seqs: list[Sequence]) -> bool:
        """Whether a decode-only step of ``seqs`` runs here: no more than the largest bucket, no adapter token."""
        return len(seqs) <= self.largest and all(seq.slot < 0 for seq in seqs)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """The decode step of ``seqs`` (each with one new token) -> fp32 logits [len(seqs), vocab].

        The logits view the graph's output buffer: valid until the next run."""
        n = len(seqs)
        bucket = bucket_for(n, self.sizes)
        if bucket is None:
            raise ValueError(f"{n} sequences exceed the largest decode bucket, {self.largest}")
        self._stage(seqs, bucket)
        graph = self._graphs.get(bucket)
        if graph is None:
            return self._forward(bucket)[:n]
        graph.replay()
        return self._outputs[bucket][:n]

    def _stage(self, seqs: list[Sequence], bucket: int) -> None:
        """Write the rows of ``seqs``, then padding rows up to ``bucket``, into the static buffer: one copy."""
        block_size = self.cache.block_size
        padding = self._padding
        values: list[int] = []
        for seq in seqs:
            pos = seq.num_tokens - 1
            table = seq.block_table
            values += (seq.token_ids[-1], pos, table[pos // block_size] * block_size + pos % block_size, pos + 1)
            values += table
            values += padding[FIELDS + len(table) :]
        values += padding * (bucket - len(seqs))
        if len(values) != bucket * (FIELDS + self.width):
            raise ValueError(f"a block table is longer than max_model_len allows ({self.width} blocks)")
        staged = torch.tensor(values, dtype=torch.int64).view(bucket, FIELDS + self.width)
        if self._static.is_cuda:
            staged = staged.pin_memory()
        self._static[:bucket].copy_(staged, non_blocking=True)

    def _forward(self, bucket: int) -> torch.Tensor:
        """The forward pass a graph captures: static rows [:bucket] -> fp32 logits [bucket, vocab]."""
        rows = self._static[:bucket]
        input_ids, positions, slots, lengths = rows[:, :FIELDS].t().contiguous().unbind()
        span = self._columns.shape[0]
        mask = (self._columns.unsqueeze(0) < lengths.unsqueeze(1)).view(1, bucket, 1, span)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode=bucket,
            decode_blocks=rows[:, FIELDS:].contiguous().view(-1),
            decode_mask=mask,
            decode_lengths=lengths,
            prefill_bounds=[],
        )
        dtype = self.cache.data.dtype
        meta.decode_bias(dtype)
        for window in self._windows:
            meta.window_decode_bias(dtype, window)
        return self.model.logits(self.model.hidden(input_ids, positions, meta, self.cache))

    def _capture(self) -> None:
        """Warm each bucket up on a side stream, then capture the largest first, all graphs in one
        memory pool (a smaller graph's temporaries reuse a larger one's; replays never overlap)."""
        self._stage([], self.largest)  # every row padding: warm-up and capture touch the scratch block only
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bucket in reversed(self.sizes):
                self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[bucket] = self._forward(bucket)
            self._graphs[bucket] = graph
        torch.cuda.synchronize()
