"""The per-step LoRA hook the engine calls after each projection (engine/lora_hook.py's LoraHook)."""

from dataclasses import dataclass, field

import torch

from kernels import LoraGroup, LoraIndex, add_lora_group, reference
from kernels.dispatch import native_bgmv_serves
from services.worker.engine.lora_hook import EXPERT_GROUPS, GROUPS, BgmvCalls
from services.worker.lora.slots import RankClassStack

GROUP_INDEX = {name: i for i, name in enumerate(GROUPS)}
GATHER_ELEMENTS = 2**24  # most A and B elements apply_experts gathers at once (64 MiB in fp32)


@dataclass(slots=True)
class ClassBatch:
    """The step's tokens of one rank class, with the stack they read."""

    stack: RankClassStack
    index: LoraIndex
    modules: frozenset[str]  # projections any of these tokens' adapters target
    workspace: torch.Tensor  # [max_tokens * rank] fp32 shrink output on CUDA, empty on CPU
    native: bool = False  # CPU: kernels.native's lora_bgmv may serve (the manager's probe passed)
    groups: dict[str, list[LoraGroup | None]] = field(init=False)  # group -> per layer, the targeted members' weights
    targeted: dict[str, tuple[str, ...]] = field(init=False)  # group -> its members these tokens target
    experts: dict[str, list[LoraGroup | None]] = field(init=False)  # the same for EXPERT_GROUPS

    def __post_init__(self) -> None:
        self.groups, self.targeted, self.experts = {}, {}, {}
        for name, members in GROUPS.items():
            targeted = tuple(m for m in members if m in self.modules)
            if targeted:
                self.groups[name] = self.stack.group(name, targeted)
                self.targeted[name] = targeted
        for name, members in EXPERT_GROUPS.items():
            targeted = tuple(m for m in members if m in self.modules)
            if targeted:
                self.experts[name] = self.stack.group(name, targeted)

    def pair_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: int64 [pairs], each routed pair's token -> each pair's row in this stack, -1 where
        its token reads another class or the base model."""
        index = self.index
        rows = torch.full((tokens.shape[0],), -1, dtype=torch.int64, device=tokens.device)  # pairs >= tokens
        rows[index.token_idx.long()] = index.token_row.long()
        return rows[tokens]


class LoraBatch:
    """Adds each token's own adapter delta, one shrink / expand pair per rank class in use.

    A rank-8 adapter is computed against the rank-8 stack only; tokens of slot -1 and classes
    or projections no token of this step targets cost nothing. A group's targeted projections
    (q/k/v, gate/up) take one call per class.
    """

    __slots__ = ("classes", "expert_groups", "groups")

    def __init__(self, classes: list[ClassBatch]):
        self.classes = classes
        self.groups: frozenset[str] = frozenset().union(*(part.groups for part in classes))
        self.expert_groups: frozenset[str] = frozenset().union(*(part.experts for part in classes))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(part.stack.rank for part in self.classes)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[:, member's columns] += scale * (x @ A[slot]) @ B[slot] per token and targeted member of
        the group, in place. x: [num_tokens, in]; y: [num_tokens, the group's fused out]."""
        for part in self.classes:
            weights = part.groups.get(group)
            if weights is not None:
                layer_weights = weights[layer]
                if layer_weights is not None:
                    stack = part.stack
                    add_lora_group(x, y, layer_weights, stack.scale, part.index, part.workspace, part.native)

    def apply_experts(
        self, layer: int, group: str, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, y: torch.Tensor
    ) -> None:
        """y[p, member's columns] += scale * (x[p] @ A[slot, expert]) @ B[slot, expert] for each routed
        pair p = (token, expert) whose token has an adapter, per targeted member of the group: one
        gathered shrink and expand per class and member over all the layer's pairs (no loop over
        tokens or experts). x: [pairs, in]; tokens, experts: int64 [pairs]; y: [pairs, the group's out]."""
        for part in self.classes:
            weights = part.experts.get(group)
            layer_weights = weights[layer] if weights is not None else None
            if layer_weights is None:
                continue
            rows = part.pair_rows(tokens)
            pairs = (rows >= 0).nonzero().squeeze(1)
            if pairs.numel() == 0:
                continue
            num_experts = layer_weights.a[0].shape[1]
            flat = rows[pairs] * num_experts + experts[pairs]  # each pair's (slot row, expert) in the flat stack
            scale = part.stack.scale.index_select(0, rows[pairs]).unsqueeze(1)  # [n, 1] fp32
            for a, b, col in zip(layer_weights.a, layer_weights.b, layer_weights.cols, strict=True):
                # a prefill's thousands of pairs gather their weights in chunks of GATHER_ELEMENTS
                chunk = max(1, GATHER_ELEMENTS // (a.shape[2] * a.shape[3] + b.shape[2] * b.shape[3]))
                for lo in range(0, pairs.shape[0], chunk):
                    p, f = pairs[lo : lo + chunk], flat[lo : lo + chunk]
                    h = reference.shrink(x, a.flatten(0, 1), p, f) * scale[lo : lo + chunk]  # [n, r] fp32
                    delta = torch.bmm(h.unsqueeze(1), b.flatten(0, 1).index_select(0, f).float()).squeeze(1)
                    cols = y[:, col : col + b.shape[-1]]
                    if p.shape[0] == cols.shape[0]:  # every pair (a decode step of one class): in place
                        cols.add_(delta.to(y.dtype))
                    else:  # each pair once: no accumulation needed (index_add_ on a column slice is slow on CPU)
                        cols[p] += delta.to(y.dtype)

    def bgmv_calls(self, dtype: torch.dtype) -> BgmvCalls | None:
        """``apply``'s deltas as lora_bgmv calls, where every one of them would take that kernel (a CPU
        stack of the model's dtype, the manager's native probe passed, segments short enough:
        kernels.dispatch.native_bgmv_serves, as add_lora_group asks), else None."""
        tensors: list[torch.Tensor] = []
        layout: list[int] = []
        for part in self.classes:
            index = part.index
            if index.num_tokens == 0:
                continue
            for name, targeted in part.targeted.items():
                weights, cols = part.stack.flat_group(name, targeted)
                if not native_bgmv_serves(part.native, index, dtype, weights[0]):
                    return None
                layout += [GROUP_INDEX[name], len(cols), *cols]
                tensors += [part.stack.scale, index.token_idx, index.token_row, *weights]
        return BgmvCalls(tensors, layout)
