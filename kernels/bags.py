"""LoRA shrink / expand on CPU as weighted embedding-bag sums: each token's adapter rows read in place.

``x[t] @ a[row]`` is ``sum_i x[t, i] * a[row, i, :]``: a bag of the rows ``row * in + i`` of ``a``
viewed as an embedding table ``[num_slots * in, r]``, weighted by ``x[t]``. The expand is the same
over ``b`` viewed as ``[num_slots * r, out]``, weighted by the scaled shrink output. torch runs
``embedding_bag`` with ``per_sample_weights`` in fbgemm's vectorised kernels, reading each weight
row where it lies. The gathered form (reference.add_lora_gathered) copies every token's A and B
first and reads them again in a bmm: for a decode step of 32 distinct rank-16 adapters that is
1.2-1.5x slower per projection on this project's CPU (bench/lora_ops.py). fp32 only: fbgemm
accumulates in the weights' dtype, and the CPU path keeps LoRA arithmetic in fp32.
"""

import torch
import torch.nn.functional as F

Bags = dict[int, tuple[torch.Tensor, torch.Tensor]]


def bag_index(token_row: torch.Tensor, width: int, cache: Bags) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, offsets) of one bag per token over the rows ``row * width .. row * width + width - 1``.

    ``cache`` holds them for the step (the same for every layer and projection of that width)."""
    if width not in cache:
        rows = token_row.to(torch.int64)
        indices = (rows.unsqueeze(1) * width + torch.arange(width, device=rows.device)).view(-1)
        offsets = torch.arange(rows.shape[0], device=rows.device) * width
        cache[width] = (indices, offsets)
    return cache[width]


def usable(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return not x.is_cuda and x.dtype == a.dtype == b.dtype == torch.float32


def add_lora_bags(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
    cache: Bags,
) -> None:
    """``y[t] += scale[row] * (x[t] @ a[row]) @ b[row]`` for each (t, row) in zip(token_idx, token_row).

    Shapes as reference.add_lora_gathered; fp32 x, a, b (see :func:`usable`); a and b contiguous."""
    rank, out_features = a.shape[2], b.shape[2]
    xs = x.index_select(0, token_idx)  # [n, in], contiguous: the shrink's per-sample weights
    indices, offsets = bag_index(token_row, a.shape[1], cache)
    h = F.embedding_bag(indices, a.view(-1, rank), offsets, mode="sum", per_sample_weights=xs.view(-1))
    h.mul_(scale.index_select(0, token_row).unsqueeze(1))
    indices, offsets = bag_index(token_row, rank, cache)
    delta = F.embedding_bag(indices, b.view(-1, out_features), offsets, mode="sum", per_sample_weights=h.view(-1))
    y.index_add_(0, token_idx, delta)
