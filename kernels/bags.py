"""LoRA shrink / expand on CPU as weighted embedding-bag sums: each token's adapter rows read in place.

``x[t] @ a[row]`` is ``sum_i x[t, i] * a[row, i, :]``: a bag of the rows ``row * in + i`` of ``a``
viewed as an embedding table ``[num_slots * in, r]``, weighted by ``x[t]``. The expand is the same
over ``b`` viewed as ``[num_slots * r, out]``, weighted by the scaled shrink output. torch runs
``embedding_bag`` with ``per_sample_weights`` in fbgemm's vectorised kernels, reading each weight
row where it lies. The gathered form (reference.add_lora_gathered) copies every token's A and B
first and reads them again in a bmm: for a decode step of 32 distinct rank-16 adapters that is
1.2-1.5x slower per projection on this project's CPU (bench/lora_ops.py). fp32 only: fbgemm
accumulates in the weights' dtype, and the CPU path keeps LoRA arithmetic in fp32.

A bag's result does not depend on the order of the bags, so the step's plan (:class:`BagPlan`) takes
the tokens in position order rather than the index's row order: when they are one run of positions
(a decode step whose every sequence has an adapter of this rank class, the common case) x is read
and y written as row views, with no gather of x and no ``index_add_``. The plan also holds what every
layer and projection of the step shares: the bag indices per width, and each token's scale.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class BagPlan:
    """One rank class's tokens for the bag path, built once per step (``of``) and shared by its calls."""

    positions: torch.Tensor  # [n] int64, the tokens' positions in x / y, ascending
    rows: torch.Tensor  # [n] int64, each one's row in the stack
    first: int  # positions are first .. first + n - 1 (read x and write y as views), else -1
    _bags: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _scale: tuple[torch.Tensor, torch.Tensor] | None = None  # (the stack's scale, its [n, 1] per-token rows)

    @classmethod
    def of(cls, token_idx: torch.Tensor, token_row: torch.Tensor) -> "BagPlan":
        """The plan for an index's (token_idx, token_row) pairs, host tensors (the bag path is CPU-only)."""
        positions, order = torch.sort(token_idx.to(torch.int64))
        rows = token_row.to(torch.int64).index_select(0, order)
        n = positions.shape[0]
        first = int(positions[0]) if n else -1
        # positions are distinct, so ascending ones are a run exactly when they span n values
        run = n > 0 and int(positions[-1]) - first == n - 1
        return cls(positions, rows, first if run else -1)

    def bag(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, offsets) of one bag per token over the rows ``row * width .. row * width + width - 1``:
        the same for every layer and projection of that width."""
        if width not in self._bags:
            indices = (self.rows.unsqueeze(1) * width + torch.arange(width)).view(-1)
            offsets = torch.arange(self.rows.shape[0]) * width
            self._bags[width] = (indices, offsets)
        return self._bags[width]

    def scale_rows(self, scale: torch.Tensor) -> torch.Tensor:
        """[n, 1]: each token's adapter scale, from the stack's ``scale`` [num_slots]."""
        if self._scale is None or self._scale[0] is not scale:
            self._scale = (scale, scale.index_select(0, self.rows).unsqueeze(1))
        return self._scale[1]


def usable(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    return not x.is_cuda and x.dtype == a.dtype == b.dtype == torch.float32


def add_lora_bags(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, plan: BagPlan
) -> None:
    """``y[t] += scale[row] * (x[t] @ a[row]) @ b[row]`` for each (t, row) of ``plan``.

    Shapes as reference.add_lora_gathered; fp32 x, a, b (see :func:`usable`); a and b contiguous."""
    rank, out_features = a.shape[2], b.shape[2]
    n = plan.positions.shape[0]
    if plan.first >= 0:
        xs = x[plan.first : plan.first + n]
    else:
        xs = x.index_select(0, plan.positions)
    indices, offsets = plan.bag(a.shape[1])
    h = F.embedding_bag(indices, a.view(-1, rank), offsets, mode="sum", per_sample_weights=xs.reshape(-1))
    h.mul_(plan.scale_rows(scale))
    indices, offsets = plan.bag(rank)
    delta = F.embedding_bag(indices, b.view(-1, out_features), offsets, mode="sum", per_sample_weights=h.view(-1))
    if plan.first >= 0:
        y[plan.first : plan.first + n].add_(delta)
    else:
        y.index_add_(0, plan.positions, delta)
