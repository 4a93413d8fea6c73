"""One step's token -> row index for a rank class, and the op that picks Triton (CUDA) or torch (CPU)."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kernels.bags import BagPlan, add_lora_bags, usable
from kernels.native import DTYPES as NATIVE_DTYPES
from kernels.native import lora_bgmv, lora_bgmv_group, native_lora
from kernels.reference import INDEX_DTYPE, Segment, add_lora_gathered, add_lora_segments

CpuLora = Literal["auto", "torch", "native"]

# CUDA: BGMV re-reads a row's weights for every token, SGMV once per BLOCK_M tokens, so BGMV only
# wins when segments are about one token long (decode).
BGMV_MAX_MEAN_SEG_LEN = 1.5
# CPU: the per-token forms (embedding bags for fp32, else the gathered bmm, which copies one weight
# row per token) against the segment loop, which pays a few op launches per segment. 32 tokens,
# rank 16, 576 x 576, 1 thread: gathered wins ~3x at 1 token per segment, they tie at ~8, segments
# win ~4x at 16 and ~10x on prefill (bench/lora_ops.py). A single segment (a batch-1 decode, or one
# adapter's tokens) always takes the loop: one fp32 matmul pair on views, 10 us against the bags' 19.
GATHER_MAX_MEAN_SEG_LEN = 4.0
# CPU with the native kernel (kernels/native.py's lora_bgmv): one call per projection group, each token's
# A and B streamed in place. Against the eager forms on SmolLM2's shapes, rank 16, 2 threads, fp32:
# 1 token 3.7 us (segments 15, bags 27), 32 tokens of 32 adapters 25 us (bags 84, segments 519),
# and it still leads a single adapter's segment up to ~128 tokens (57 us against 73); at 256 they
# tie, so longer segments (prefill) keep the segment loop's matmuls. bf16 leads further (the eager
# forms widen copies): 32 distinct 24 us against 860.
NATIVE_MAX_MEAN_SEG_LEN = 128.0


def use_native_lora(mode: CpuLora, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether CPU LoRA steps take kernels.native's ``lora_bgmv``: ``auto`` where it applies (CPU, fp32
    or bf16 stacks) and builds and passes its probe here, ``torch`` never, ``native`` always (raises
    ValueError where it cannot)."""
    if mode == "torch":
        return False
    if torch.device(device).type == "cpu" and dtype in NATIVE_DTYPES and native_lora():
        return True
    if mode == "native":
        raise ValueError(
            f"cpu_kernel='native' is not usable for {device} {dtype}: the LoRA kernel serves CPU fp32 and bf16, "
            "and needs a C++ toolchain to build (see the log)"
        )
    return False


@dataclass(slots=True)
class LoraIndex:
    """The tokens of one rank class in one step, sorted by their row in the class's stack."""

    token_idx: torch.Tensor  # [n] int32, positions in x / y
    token_row: torch.Tensor  # [n] int32, stack row of each token_idx entry
    seg_start: torch.Tensor  # [num_segments + 1] int32, offsets into token_idx
    seg_row: torch.Tensor  # [num_segments] int32, stack row of each segment
    max_seg_len: int
    segments: tuple[Segment, ...]  # host copy of the segments, for the CPU path
    bags: BagPlan | None = None  # the CPU bag path's plan, built on its first use in the step (bag_plan)

    @property
    def num_tokens(self) -> int:
        return self.token_idx.shape[0]

    @property
    def mean_seg_len(self) -> float:
        return self.num_tokens / max(1, len(self.segments))

    def bag_plan(self) -> BagPlan:
        """The bag path's plan for these tokens, built once and shared by every layer and projection."""
        if self.bags is None:
            self.bags = BagPlan.of(self.token_idx, self.token_row)
        return self.bags


def find_segments(token_idx: Sequence[int], token_row: Sequence[int]) -> tuple[Segment, ...]:
    """Runs of equal rows in host lists sorted by row (stable, so token_idx ascends in a run).

    Plain Python on lists: a decode step's few dozen tokens take microseconds, where the tensor form's
    dozen small ops took ~150 us a step.
    """
    segments: list[Segment] = []
    n, start = len(token_row), 0
    while start < n:
        row, end = token_row[start], start + 1
        while end < n and token_row[end] == row:
            end += 1
        first = token_idx[start]
        segments.append((start, end, row, first if token_idx[end - 1] - first == end - 1 - start else -1))
        start = end
    return tuple(segments)


def index_for(token_rows: torch.Tensor, device: torch.device | str = "cpu") -> LoraIndex:
    """A freshly allocated index for per-token rows ([num_tokens], -1 = no adapter); tests and benches."""
    rows = token_rows.to("cpu", torch.int64)
    keep = torch.nonzero(rows >= 0).squeeze(1)
    token_row, order = torch.sort(rows[keep], stable=True)
    token_idx = keep[order].to(INDEX_DTYPE)
    token_row = token_row.to(INDEX_DTYPE)
    segments = find_segments(token_idx.tolist(), token_row.tolist())
    seg_start = torch.tensor([s[0] for s in segments] + [token_idx.shape[0]], dtype=INDEX_DTYPE)
    seg_row = torch.tensor([s[2] for s in segments], dtype=INDEX_DTYPE)
    return LoraIndex(
        token_idx=token_idx.to(device),
        token_row=token_row.to(device),
        seg_start=seg_start.to(device),
        seg_row=seg_row.to(device),
        max_seg_len=max((e - s for s, e, _, _ in segments), default=0),
        segments=segments,
    )


def add_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    index: LoraIndex,
    workspace: torch.Tensor,
    native: bool = False,
) -> None:
    """``y[t] += scale[row] * (x[t] @ a[row]) @ b[row]`` for each indexed token t, in place.

    x: [num_tokens, in]; y: [num_tokens, out]; a: [num_slots, in, r]; b: [num_slots, r, out];
    scale: [num_slots] fp32; workspace: fp32, at least n * r elements (used on CUDA only);
    native: on CPU, the native kernel may serve (only where :func:`use_native_lora` said so).
    """
    n, rank = index.num_tokens, a.shape[2]
    if n == 0:
        return
    if not x.is_cuda:
        if native_bgmv_serves(native, index, x.dtype, a):
            lora_bgmv(x, y, a, b, scale, index.token_idx, index.token_row)
        elif len(index.segments) == 1 or index.mean_seg_len > GATHER_MAX_MEAN_SEG_LEN:
            add_lora_segments(x, y, a, b, scale, index.token_idx, index.segments)
        elif usable(x, a, b):
            add_lora_bags(x, y, a, b, scale, index.bag_plan())
        else:
            add_lora_gathered(x, y, a, b, scale, index.token_idx, index.token_row)
        return
    # Imported on first CUDA use: a CPU worker never pays for importing Triton, and tests can set
    # TRITON_INTERPRET before the kernels are decorated.
    from kernels.bgmv import bgmv_expand, bgmv_shrink
    from kernels.sgmv import sgmv_expand, sgmv_shrink

    h = workspace.view(-1)[: n * rank].view(n, rank)
    if index.mean_seg_len <= BGMV_MAX_MEAN_SEG_LEN:
        bgmv_shrink(x, a, index.token_idx, index.token_row, h)
        bgmv_expand(h, b, scale, index.token_idx, index.token_row, y)
    else:
        segs = (index.seg_start, index.seg_row, index.max_seg_len)
        sgmv_shrink(x, a, index.token_idx, index.token_row, *segs, h)
        sgmv_expand(h, b, scale, index.token_idx, index.token_row, *segs, y)


@dataclass(frozen=True, slots=True)
class LoraGroup:
    """One layer's LoRA weights for projections that read the same input (q/k/v, gate/up), each
    adding into its own columns of the group's fused output."""

    a: tuple[torch.Tensor, ...]  # per projection: [num_slots, in, r], one r
    b: tuple[torch.Tensor, ...]  # per projection: [num_slots, r, out_m]
    cols: tuple[int, ...]  # per projection: its first column in the fused output


def native_bgmv_serves(native: bool, index: LoraIndex, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether the native ``lora_bgmv`` kernel takes a step's tokens of one rank class for inputs of
    ``dtype`` against ``weight`` (one of its A stacks): allowed (``native``, :func:`use_native_lora`),
    on CPU, segments short enough, inputs of the weights' dtype. The engine's native layer loop asks
    the same (services/worker/lora/applier.py)."""
    return native and not weight.is_cuda and index.mean_seg_len <= NATIVE_MAX_MEAN_SEG_LEN and dtype == weight.dtype


def add_lora_group(
    x: torch.Tensor,
    y: torch.Tensor,
    group: LoraGroup,
    scale: torch.Tensor,
    index: LoraIndex,
    workspace: torch.Tensor,
    native: bool = False,
) -> None:
    """:func:`add_lora` for each projection of ``group``, into ``y[:, cols[m] : cols[m] + out_m]``: the
    native kernel takes them all in one call; the other paths take them one by one on column views."""
    if index.num_tokens == 0:
        return
    if native_bgmv_serves(native, index, x.dtype, group.a[0]):
        lora_bgmv_group(x, y, group.a, group.b, group.cols, scale, index.token_idx, index.token_row)
        return
    for a, b, col in zip(group.a, group.b, group.cols, strict=True):
        add_lora(x, y[:, col : col + b.shape[2]], a, b, scale, index, workspace, native)
