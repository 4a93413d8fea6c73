"""Fixed-shape LoRA for the CUDA-graph decode step: static index rows per rank class, bucketed counts.

A graph decode step of ``bucket`` rows stages, per rank class, its adapter tokens sorted by slot into
static rows ``[max_rows]`` (token, stack row, live), padded up to the class's count bucket
(``count_bucket``: 0, 1, 2, 4, ... capped at the batch bucket) with dead rows (token 0, stack row 0,
live 0). The captured forward reads the first ``count`` rows of each class: a gathered shrink
``x[idx] @ A[row]`` and expand ``(h * scale[row] * live) @ B[row]`` added with ``index_add_``; a dead
row adds an exact zero. Shapes depend on the key alone, and nothing is read back to the host.

Every projection a class's stack holds is applied (a row not targeting it holds zeros there), since
which modules a step's adapters target is host data a graph cannot branch on.
"""

import torch

from kernels import reference
from services.worker.engine.lora_hook import GROUPS, BgmvCalls
from services.worker.lora.slots import RankClassStack

LIVE = 2  # the static rows' third field: 1 for a staged token, 0 for a padding row


def count_bucket(count: int, bucket: int) -> int:
    """Rows a class's ``count`` adapter tokens take in a graph of batch ``bucket``: 0, or the smallest
    power of two >= count, capped at ``bucket``."""
    if not 0 <= count <= bucket:
        raise ValueError(f"a class has 0 to {bucket} tokens in a bucket of {bucket}, got {count}")
    return 0 if count == 0 else min(1 << (count - 1).bit_length(), bucket)


def count_buckets(bucket: int) -> list[int]:
    """Every count bucket of a batch bucket: 0, 1, 2, 4, ... and the bucket itself."""
    return sorted({0} | {count_bucket(n, bucket) for n in range(1, bucket + 1)})


class StaticLora:
    """The graph step's LoRA hook (engine/lora_hook.py's LoraHook) over static rows of every rank class."""

    def __init__(self, stacks: tuple[RankClassStack, ...], max_rows: int, device: torch.device | str):
        self.stacks = stacks
        self.first_slots = [stack.first_slot for stack in stacks] + [stacks[-1].first_slot + stacks[-1].num_slots]
        self.rows = torch.zeros(len(stacks), 3, max_rows, dtype=torch.int64, device=device)  # [class, field, row]
        self.counts: tuple[int, ...] = (0,) * len(stacks)  # the key's count buckets the forward reads
        self.used: tuple[int, ...] = ()  # ranks of the classes the staged step's tokens read
        self._groups = {
            name: [tuple(m for m in members if m in stack.a[0]) for stack in stacks] for name, members in GROUPS.items()
        }

    def key(self, token_slots: list[int], bucket: int) -> tuple[int, ...]:
        """Per rank class, the count bucket of ``token_slots``'s tokens in that class (-1 = base)."""
        counts = [0] * len(self.stacks)
        for slot in token_slots:
            if slot >= 0:
                counts[self._class_of(slot)] += 1
        return tuple(count_bucket(n, bucket) for n in counts)

    def stage(self, token_slots: list[int], counts: tuple[int, ...]) -> None:
        """Write each class's tokens, sorted by slot, then dead rows up to its count bucket: one copy
        (none for a base-model step, whose forward reads no row)."""
        if not any(counts):
            self.used = ()
            return
        width = self.rows.shape[2]
        per_class: list[list[tuple[int, int]]] = [[] for _ in self.stacks]
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                c = self._class_of(slot)
                per_class[c].append((slot - self.first_slots[c], token))
        values: list[int] = []
        for staged, count in zip(per_class, counts, strict=True):
            staged.sort()
            if len(staged) > count:
                raise ValueError(f"{len(staged)} tokens exceed their class's count bucket, {count}")
            dead = width - len(staged)
            values += [token for _, token in staged] + [0] * dead
            values += [row for row, _ in staged] + [0] * dead
            values += [1] * len(staged) + [0] * dead
        host = torch.tensor(values, dtype=torch.int64).view(self.rows.shape)
        if self.rows.is_cuda:
            host = host.pin_memory()
        self.rows.copy_(host, non_blocking=True)
        self.used = tuple(stack.rank for stack, staged in zip(self.stacks, per_class, strict=True) if staged)

    def _class_of(self, slot: int) -> int:
        for c in range(len(self.stacks)):
            if slot < self.first_slots[c + 1]:
                return c
        raise ValueError(f"slot {slot} is past the pool's {self.first_slots[-1]} slots")

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.used

    @property
    def groups(self) -> frozenset[str]:
        return frozenset(name for name, per_class in self._groups.items() if any(per_class))

    @property
    def expert_groups(self) -> frozenset[str]:
        return frozenset()  # the engine refuses graphs for a mixture-of-experts model

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[:, member's columns] += scale * (x @ A[slot]) @ B[slot] for the staged rows of each class in
        the key, in place; x: [bucket, in]; y: [bucket, the group's fused out]."""
        for c, (stack, count) in enumerate(zip(self.stacks, self.counts, strict=True)):
            members = self._groups[group][c]
            if count == 0 or not members:
                continue
            weights = stack.group(group, members)[layer]
            if weights is None:
                continue
            idx, row, live = self.rows[c, :, :count].unbind()
            scale = (stack.scale.index_select(0, row) * live).unsqueeze(1)  # [count, 1] fp32, 0 on dead rows
            for a, b, col in zip(weights.a, weights.b, weights.cols, strict=True):
                h = reference.shrink(x, a, idx, row) * scale  # [count, r] fp32
                delta = torch.bmm(h.unsqueeze(1), b.index_select(0, row).float()).squeeze(1)  # [count, out]
                y[:, col : col + b.shape[2]].index_add_(0, idx, delta.to(y.dtype))

    def apply_experts(
        self, layer: int, group: str, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, y: torch.Tensor
    ) -> None:
        raise NotImplementedError("the engine refuses CUDA graphs for a mixture-of-experts model")

    def bgmv_calls(self, dtype: torch.dtype) -> BgmvCalls | None:
        return None  # the graph's forward runs the Python layer loop
