"""CUDA graphs of the decode step: one graph per batch-size bucket (and LoRA mix), replayed over static buffers.

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

LoRA: with an adapter manager, a graph's key is (batch bucket, per rank class count bucket), the
counts of the step's adapter tokens in each class bucketed to 0, 1, 2, 4, ... capped at the batch
bucket (lora/graph.py's ``count_bucket``). The step's adapter tokens are staged, sorted by (class,
slot), into the hook's static rows, padded per class with dead rows that add an exact zero; the
captured forward runs a gathered shrink / expand over those rows, fixed shapes, no host read. A
batch bucket ``B`` has at most ``K = len(count_buckets(B))`` (``ceil(log2 B) + 2``) count buckets per
class, so at most ``K ** classes`` keys; the base-model keys (every count 0) are captured at start,
the others on their first step (a step's warm-up, capture and replay: idempotent K/V writes), so only
the mixes that occur cost graph memory, all in one pool. Prefill and mixed steps always run eagerly.

With ``capture=False`` the same ``_forward`` runs without capture: the path the CPU tests compare
with the eager step, on any device.
"""

import bisect

import torch

from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.kv_cache import KVCache
from services.worker.engine.lora_hook import GraphLoraHook
from services.worker.engine.model import LlamaForward
from services.worker.engine.sequence import Sequence

MAX_GRAPH_BATCH = 512  # vLLM's default largest capture: beyond it, replay saves little over the step's work
FIELDS = 4  # per row: input id, position, cache slot, context length; then the block table

GraphKey = tuple[int, tuple[int, ...]]  # (batch bucket, per rank class count bucket)


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
    """Static decode buffers at the largest bucket, and on CUDA one captured graph per key (batch bucket,
    and with a LoRA hook each rank class's row-count bucket)."""

    def __init__(
        self,
        model: LlamaForward,
        cache: KVCache,
        scratch_block: int,
        max_model_len: int,
        sizes: list[int],
        capture: bool = True,
        lora: GraphLoraHook | None = None,
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
        self.lora = lora
        self._base = lora.counts if lora is not None else ()  # every class's count 0
        self._graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[GraphKey, torch.Tensor] = {}  # key -> its graph's logits [bucket, vocab]
        self._pool = torch.cuda.graph_pool_handle() if capture else None  # every graph's memory
        self.capture = capture
        if capture:
            self._capture()

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def fits(self, seqs: list[Sequence]) -> bool:
        """Whether a decode-only step of ``seqs`` runs here: no more than the largest bucket, and an
        adapter token only with a LoRA hook."""
        return len(seqs) <= self.largest and (self.lora is not None or all(seq.slot < 0 for seq in seqs))

    def key(self, seqs: list[Sequence]) -> GraphKey | None:
        """The graph a decode step of ``seqs`` replays: its batch bucket and per class count buckets;
        None above the largest bucket."""
        bucket = bucket_for(len(seqs), self.sizes)
        if bucket is None:
            return None
        if self.lora is None:
            return bucket, ()
        return bucket, self.lora.key([seq.slot for seq in seqs], bucket)

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """The decode step of ``seqs`` (each with one new token) -> fp32 logits [len(seqs), vocab].

        The logits view the graph's output buffer: valid until the next run."""
        n = len(seqs)
        key = self.key(seqs)
        if key is None:
            raise ValueError(f"{n} sequences exceed the largest decode bucket, {self.largest}")
        bucket, counts = key
        self._stage(seqs, bucket)
        if self.lora is not None:
            self.lora.stage([seq.slot for seq in seqs], counts)
        graph = self._graphs.get(key)
        if graph is None and self.capture:
            graph = self._capture_key(key)  # a LoRA mix's first step: captured now, replayed below
        if graph is None:
            return self._forward(key)[:n]
        graph.replay()
        return self._outputs[key][:n]

    @property
    def hook(self) -> GraphLoraHook | None:
        """The LoRA hook of the last run, where its step had adapter tokens (the step's rank mix)."""
        return self.lora if self.lora is not None and self.lora.ranks else None

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

    def _forward(self, key: GraphKey) -> torch.Tensor:
        """The forward pass a graph captures: static rows [:bucket] and, with adapter rows in the key,
        the LoRA hook's static rows -> fp32 logits [bucket, vocab]."""
        bucket, counts = key
        lora = None
        if self.lora is not None and any(counts):
            self.lora.counts = counts
            lora = self.lora
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
        return self.model.logits(self.model.hidden(input_ids, positions, meta, self.cache, lora))

    def _capture(self) -> None:
        """Warm each base-model key up on a side stream, then capture the largest first, all graphs in
        one memory pool (a smaller graph's temporaries reuse a larger one's; replays never overlap)."""
        self._stage([], self.largest)  # every row padding: warm-up and capture touch the scratch block only
        keys = [(bucket, self._base) for bucket in reversed(self.sizes)]
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for key in keys:
                self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        for key in keys:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._outputs[key] = self._forward(key)
            self._graphs[key] = graph
        torch.cuda.synchronize()

    def _capture_key(self, key: GraphKey) -> torch.cuda.CUDAGraph:
        """Capture one key over the rows staged for it, into the shared pool: a warm-up forward on a side
        stream (its K/V writes are the replay's own), then the capture."""
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[key] = self._forward(key)
        self._graphs[key] = graph
        return graph
