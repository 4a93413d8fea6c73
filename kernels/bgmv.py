"""BGMV: gathered LoRA shrink / expand, one program per token (decode, where tokens rarely share a row).

Operands are loaded and upcast to fp32 before any arithmetic: the Triton interpreter stores
bf16 as raw uint16 and does integer arithmetic on it, and on GPU these ops are bound by memory,
not by math, so fp32 arithmetic costs nothing measurable.
"""

import torch
import triton
import triton.language as tl

from kernels.reference import check_expand, check_shrink


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _bgmv_shrink_kernel(  # type: ignore[no-untyped-def]  # Triton gives parameter annotations its own meaning
    x_ptr, a_ptr, idx_ptr, row_ptr, h_ptr,
    in_features, rank,
    stride_x, stride_a,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    token = tl.load(idx_ptr + i).to(tl.int64)
    row = tl.load(row_ptr + i).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + offs_k
        xv = tl.load(x_ptr + token * stride_x + k, mask=k < in_features, other=0.0).to(tl.float32)
        a_mask = (k[:, None] < in_features) & (offs_r[None, :] < rank)
        av = tl.load(a_ptr + row * stride_a + k[:, None] * rank + offs_r[None, :], mask=a_mask, other=0.0)
        acc += tl.sum(xv[:, None] * av.to(tl.float32), axis=0)
    tl.store(h_ptr + i * rank + offs_r, acc, mask=offs_r < rank)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no type information
def _bgmv_expand_kernel(  # type: ignore[no-untyped-def]  # Triton gives parameter annotations its own meaning
    h_ptr, b_ptr, scale_ptr, idx_ptr, row_ptr, y_ptr,
    rank, out_features,
    stride_b, stride_y,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token = tl.load(idx_ptr + i).to(tl.int64)
    row = tl.load(row_ptr + i).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    hv = tl.load(h_ptr + i * rank + offs_r, mask=offs_r < rank, other=0.0)
    b_mask = (offs_r[:, None] < rank) & (offs_n[None, :] < out_features)
    bv = tl.load(b_ptr + row * stride_b + offs_r[:, None] * out_features + offs_n[None, :], mask=b_mask, other=0.0)
    delta = tl.sum(hv[:, None] * bv.to(tl.float32), axis=0) * tl.load(scale_ptr + row)
    y_ptrs = y_ptr + token * stride_y + offs_n
    yv = tl.load(y_ptrs, mask=offs_n < out_features, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + delta).to(y_ptr.dtype.element_ty), mask=offs_n < out_features)


def bgmv_shrink(
    x: torch.Tensor, a: torch.Tensor, token_idx: torch.Tensor, token_row: torch.Tensor, h: torch.Tensor
) -> None:
    """``h[i] = x[token_idx[i]] @ a[token_row[i]]``, written in place.

    x: [num_tokens, in] (rows contiguous); a: [num_slots, in, r] contiguous, x's dtype;
    token_idx, token_row: [n] int32; h: [n, r] fp32 contiguous.
    """
    check_shrink(x, a, token_idx, token_row, h)
    n, rank = h.shape
    if n == 0:
        return
    in_features = x.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = min(triton.next_power_of_2(in_features), max(16, 4096 // block_r))
    _bgmv_shrink_kernel[(n,)](
        x, a, token_idx, token_row, h, in_features, rank, x.stride(0), a.stride(0), BLOCK_K=block_k, BLOCK_R=block_r
    )


def bgmv_expand(
    h: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """``y[token_idx[i]] += scale[token_row[i]] * h[i] @ b[token_row[i]]``, in place.

    h: [n, r] fp32 contiguous; b: [num_slots, r, out] contiguous; scale: [num_slots] fp32;
    token_idx, token_row: [n] int32; y: [num_tokens, out], b's dtype, columns contiguous (a column
    view of a fused projection output is fine).
    """
    check_expand(h, b, scale, token_idx, token_row, y)
    n, rank = h.shape
    if n == 0:
        return
    out_features = y.shape[1]
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = min(triton.next_power_of_2(out_features), 128)
    grid = (n, triton.cdiv(out_features, block_n))
    _bgmv_expand_kernel[grid](
        h, b, scale, token_idx, token_row, y, rank, out_features, b.stride(0), y.stride(0),
        BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
