"""SGMV: segmented LoRA shrink / expand (prefill, where runs of tokens share a row).

Each program takes a BLOCK_M tile of one segment's tokens and runs a ``tl.dot`` against that
segment's row. Operands are upcast to fp32 before the dot, as in :mod:`kernels.bgmv`. On GPU the
dot runs in tf32, which holds fp16 / bf16 values exactly: for those models only the fp32
intermediate ``h`` is rounded (as when punica / vLLM store it in the model dtype).
"""

import torch
import triton
import triton.language as tl

from kernels.reference import check_expand, check_shrink

BLOCK_M = 16


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _sgmv_shrink_kernel(  # type: ignore[no-untyped-def]  # Triton gives parameter annotations its own meaning
    x_ptr, a_ptr, idx_ptr, seg_start_ptr, seg_row_ptr, h_ptr,
    in_features, rank,
    stride_x, stride_a,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    row = tl.load(seg_row_ptr + seg).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < end
    tokens = tl.load(idx_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        x_mask = m_mask[:, None] & (k[None, :] < in_features)
        xv = tl.load(x_ptr + tokens[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0)
        a_mask = (k[:, None] < in_features) & (offs_r[None, :] < rank)
        av = tl.load(a_ptr + row * stride_a + k[:, None] * rank + offs_r[None, :], mask=a_mask, other=0.0)
        acc += tl.dot(xv.to(tl.float32), av.to(tl.float32))
    h_mask = m_mask[:, None] & (offs_r[None, :] < rank)
    tl.store(h_ptr + offs_m[:, None] * rank + offs_r[None, :], acc, mask=h_mask)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _sgmv_expand_kernel(  # type: ignore[no-untyped-def]  # Triton gives parameter annotations its own meaning
    h_ptr, b_ptr, scale_ptr, idx_ptr, seg_start_ptr, seg_row_ptr, y_ptr,
    rank, out_features,
    stride_b, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    row = tl.load(seg_row_ptr + seg).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < end
    n_mask = offs_n < out_features
    tokens = tl.load(idx_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    h_mask = m_mask[:, None] & (offs_r[None, :] < rank)
    hv = tl.load(h_ptr + offs_m[:, None] * rank + offs_r[None, :], mask=h_mask, other=0.0)
    b_mask = (offs_r[:, None] < rank) & n_mask[None, :]
    bv = tl.load(b_ptr + row * stride_b + offs_r[:, None] * out_features + offs_n[None, :], mask=b_mask, other=0.0)
    delta = tl.dot(hv, bv.to(tl.float32)) * tl.load(scale_ptr + row)
    y_ptrs = y_ptr + tokens[:, None] * stride_y + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    yv = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + delta).to(y_ptr.dtype.element_ty), mask=y_mask)


def _check_segments(seg_start: torch.Tensor, seg_row: torch.Tensor, token_idx: torch.Tensor) -> None:
    assert seg_start.dtype == seg_row.dtype == token_idx.dtype, "seg_start and seg_row must be int32"
    assert seg_start.is_contiguous() and seg_row.is_contiguous(), "seg_start and seg_row must be contiguous"
    assert seg_start.shape == (seg_row.shape[0] + 1,), "seg_start must be [num_segments + 1]"
    assert seg_start.device == token_idx.device, "the segments must live on the index's device"


def sgmv_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
    seg_start: torch.Tensor,
    seg_row: torch.Tensor,
    max_seg_len: int,
    h: torch.Tensor,
) -> None:
    """``h[s:e] = x[token_idx[s:e]] @ a[seg_row[g]]`` for each segment g = (s, e), in place.

    x: [num_tokens, in] (rows contiguous); a: [num_slots, in, r] contiguous, x's dtype;
    token_idx, token_row: [n] int32 (token_row[s:e] == seg_row[g]); seg_start: [num_segments + 1]
    int32 offsets into token_idx; seg_row: [num_segments] int32; max_seg_len: longest e - s;
    h: [n, r] fp32 contiguous.
    """
    check_shrink(x, a, token_idx, token_row, h)
    _check_segments(seg_start, seg_row, token_idx)
    num_segments, rank = seg_row.shape[0], h.shape[1]
    if num_segments == 0:
        return
    in_features = x.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = max(16, min(triton.next_power_of_2(in_features), 64))
    grid = (num_segments, triton.cdiv(max_seg_len, BLOCK_M))
    _sgmv_shrink_kernel[grid](
        x, a, token_idx, seg_start, seg_row, h, in_features, rank, x.stride(0), a.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_R=block_r,
    )  # fmt: skip


def sgmv_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
    seg_start: torch.Tensor,
    seg_row: torch.Tensor,
    max_seg_len: int,
    y: torch.Tensor,
) -> None:
    """``y[token_idx[s:e]] += scale[seg_row[g]] * h[s:e] @ b[seg_row[g]]`` for each segment g, in place.

    h: [n, r] fp32 contiguous; b: [num_slots, r, out] contiguous; scale: [num_slots] fp32;
    token_idx, token_row, seg_start, seg_row, max_seg_len: as in :func:`sgmv_shrink`;
    y: [num_tokens, out], b's dtype, columns contiguous (a column view of a fused output is fine).
    """
    check_expand(h, b, scale, token_idx, token_row, y)
    _check_segments(seg_start, seg_row, token_idx)
    num_segments, rank = seg_row.shape[0], h.shape[1]
    if num_segments == 0:
        return
    out_features = y.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = max(16, min(triton.next_power_of_2(out_features), 64))
    grid = (num_segments, triton.cdiv(max_seg_len, BLOCK_M), triton.cdiv(out_features, block_n))
    _sgmv_expand_kernel[grid](
        h, b, scale, token_idx, seg_start, seg_row, y, rank, out_features, b.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
