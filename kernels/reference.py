"""LoRA shrink / expand in plain torch: the CPU path and the reference of the Triton kernels.

Every op reads one rank class's stacked weights: ``a [num_slots, in, r]``, ``b [num_slots, r, out]``,
``scale [num_slots]`` (alpha / r, or alpha / sqrt(r) for rsLoRA). Tokens are addressed through
``token_idx`` (positions in ``x`` / ``y``) and ``token_row`` (their row in the stack), sorted by row,
so the same index drives the gathered (BGMV) and segmented (SGMV) forms. Arithmetic is fp32.
"""

from collections.abc import Sequence

import torch

INDEX_DTYPE = torch.int32

# (start, end) into token_idx, the stack row, and the first token of a contiguous run or -1.
Segment = tuple[int, int, int, int]


def shrink(x: torch.Tensor, a: torch.Tensor, token_idx: torch.Tensor, token_row: torch.Tensor) -> torch.Tensor:
    """``h[i] = x[token_idx[i]] @ a[token_row[i]]`` -> fp32 ``h [n, r]``.

    x: [num_tokens, in]; a: [num_slots, in, r]; token_idx, token_row: [n].
    """
    xs = x.index_select(0, token_idx).float().unsqueeze(1)  # [n, 1, in]
    return torch.bmm(xs, a.index_select(0, token_row).float()).squeeze(1)


def expand(
    h: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """``y[token_idx[i]] += scale[token_row[i]] * h[i] @ b[token_row[i]]``, in place.

    h: [n, r] fp32; b: [num_slots, r, out]; scale: [num_slots] fp32; token_idx, token_row: [n];
    y: [num_tokens, out] (any row stride).
    """
    hs = (h * scale.index_select(0, token_row).unsqueeze(1)).unsqueeze(1)  # [n, 1, r]
    delta = torch.bmm(hs, b.index_select(0, token_row).float()).squeeze(1)  # [n, out]
    y.index_add_(0, token_idx, delta.to(y.dtype))


def add_lora_gathered(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
) -> None:
    """``y[t] += scale[row] * (x[t] @ a[row]) @ b[row]`` for each (t, row) in zip(token_idx, token_row).

    x: [num_tokens, in]; y: [num_tokens, out] (any row stride); a: [num_slots, in, r];
    b: [num_slots, r, out]; scale: [num_slots] fp32; token_idx, token_row: [n].
    One batched matmul per op over gathered weight copies: fastest on CPU when most tokens have
    their own row (decode), see bench/lora_ops.py.
    """
    expand(shrink(x, a, token_idx, token_row), b, scale, token_idx, token_row, y)


def add_lora_segments(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    segments: Sequence[Segment],
) -> None:
    """``y[token_idx[s:e]] += scale[row] * (x[token_idx[s:e]] @ a[row]) @ b[row]`` per (s, e, row, _) segment.

    x, y, a, b, scale: as in :func:`add_lora_gathered`; token_idx: [n]; segments: host tuples
    (start, end, row, first token of a contiguous run or -1), so the loop never reads a tensor back.
    One matmul pair per segment; a contiguous run reads and writes views of x and y (no copies, and in
    fp32 the expand is one ``addmm_`` into y): fastest on CPU when tokens share rows (prefill) and
    when a step has only a few segments (a decode batch of one or two adapters).
    """
    in_place = x.dtype == y.dtype == a.dtype == b.dtype == torch.float32
    for start, end, row, first in segments:
        if first >= 0:
            xs = x[first : first + end - start]
        else:
            idx = token_idx[start:end]
            xs = x.index_select(0, idx)
        h = torch.mm(xs.float(), a[row].float()).mul_(scale[row])
        if in_place and first >= 0:  # fp32 on a view: the expand accumulates straight into y
            y[first : first + end - start].addmm_(h, b[row])
            continue
        delta = torch.mm(h, b[row].float()).to(y.dtype)
        if first >= 0:
            y[first : first + end - start].add_(delta)
        else:
            y.index_add_(0, idx, delta)


def check_shrink(
    x: torch.Tensor, a: torch.Tensor, token_idx: torch.Tensor, token_row: torch.Tensor, h: torch.Tensor
) -> None:
    """The shrink kernels' contract: shapes, dtypes, devices and layouts their launchers rely on."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [num_tokens, in] with contiguous rows, got {x.shape}"
    assert a.dim() == 3 and a.is_contiguous(), f"a must be a contiguous [num_slots, in, r], got {a.shape}"
    assert a.shape[1] == x.shape[1], f"a has in={a.shape[1]}, x has {x.shape[1]}"
    assert a.dtype == x.dtype, f"a is {a.dtype}, x is {x.dtype}"
    _check_index(token_idx, token_row, x)
    assert h.dtype == torch.float32 and h.is_contiguous(), "h must be a contiguous fp32 workspace"
    assert h.shape == (token_idx.shape[0], a.shape[2]), f"h must be [n, r] = {(token_idx.shape[0], a.shape[2])}"
    assert a.device == h.device == x.device, "x, a and h must share a device"


def check_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """The expand kernels' contract (see :func:`check_shrink`)."""
    assert y.dim() == 2 and y.stride(1) == 1, f"y must be [num_tokens, out] with contiguous rows, got {y.shape}"
    assert b.dim() == 3 and b.is_contiguous(), f"b must be a contiguous [num_slots, r, out], got {b.shape}"
    assert b.shape[2] == y.shape[1], f"b has out={b.shape[2]}, y has {y.shape[1]}"
    assert b.dtype == y.dtype, f"b is {b.dtype}, y is {y.dtype}"
    assert scale.shape == (b.shape[0],) and scale.dtype == torch.float32, "scale must be fp32 [num_slots]"
    _check_index(token_idx, token_row, y)
    assert h.dtype == torch.float32 and h.is_contiguous(), "h must be a contiguous fp32 workspace"
    assert h.shape == (token_idx.shape[0], b.shape[1]), f"h must be [n, r] = {(token_idx.shape[0], b.shape[1])}"
    assert b.device == h.device == y.device == scale.device, "h, b, scale and y must share a device"


def _check_index(token_idx: torch.Tensor, token_row: torch.Tensor, data: torch.Tensor) -> None:
    assert token_idx.dtype == token_row.dtype == INDEX_DTYPE, "token_idx and token_row must be int32"
    assert token_idx.dim() == 1 and token_idx.shape == token_row.shape, "token_idx and token_row must be [n]"
    assert token_idx.is_contiguous() and token_row.is_contiguous(), "token_idx and token_row must be contiguous"
    assert token_idx.device == token_row.device == data.device, "the index must live on the data's device"
