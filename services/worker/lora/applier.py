"""The per-step LoRA hook the engine calls after each projection (engine/lora_hook.py's LoraHook)."""

from dataclasses import dataclass, field

import torch

from kernels import LoraGroup, LoraIndex, add_lora_group
from kernels.dispatch import native_bgmv_serves
from services.worker.engine.lora_hook import GROUPS, BgmvCalls
from services.worker.lora.slots import RankClassStack

GROUP_INDEX = {name: i for i, name in enumerate(GROUPS)}


@dataclass(slots=True)
class ClassBatch:
    """The step's tokens of one rank class, with the stack they read."""

    stack: RankClassStack
    index: LoraIndex
    modules: frozenset[str]  # projections any of these tokens' adapters target
    workspace: torch.Tensor  # [max_tokens * rank] fp32 shrink output on CUDA, empty on CPU
    native: bool = False  # CPU: kernels.native's lora_bgmv may serve (the manager's probe passed)
    groups: dict[str, list[LoraGroup]] = field(init=False)  # group -> per layer, the targeted members' weights
    targeted: dict[str, tuple[str, ...]] = field(init=False)  # group -> its members these tokens target

    def __post_init__(self) -> None:
        self.groups, self.targeted = {}, {}
        for name, members in GROUPS.items():
            targeted = tuple(m for m in members if m in self.modules)
            if targeted:
                self.groups[name] = self.stack.group(name, targeted)
                self.targeted[name] = targeted


class LoraBatch:
    """Adds each token's own adapter delta, one shrink / expand pair per rank class in use.

    A rank-8 adapter is computed against the rank-8 stack only; tokens of slot -1 and classes
    or projections no token of this step targets cost nothing. A group's targeted projections
    (q/k/v, gate/up) take one call per class.
    """

    __slots__ = ("classes", "groups")

    def __init__(self, classes: list[ClassBatch]):
        self.classes = classes
        self.groups: frozenset[str] = frozenset().union(*(part.groups for part in classes))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(part.stack.rank for part in self.classes)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[:, member's columns] += scale * (x @ A[slot]) @ B[slot] per token and targeted member of
        the group, in place. x: [num_tokens, in]; y: [num_tokens, the group's fused out]."""
        for part in self.classes:
            weights = part.groups.get(group)
            if weights is not None:
                stack = part.stack
                add_lora_group(x, y, weights[layer], stack.scale, part.index, part.workspace, part.native)

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
