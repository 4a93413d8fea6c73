"""The per-step LoRA hook the engine calls after each projection (engine/lora_hook.py's LoraHook)."""

from dataclasses import dataclass, field

import torch

from kernels import LoraGroup, LoraIndex, add_lora_group
from services.worker.engine.lora_hook import GROUPS
from services.worker.lora.slots import RankClassStack


@dataclass(slots=True)
class ClassBatch:
    """The step's tokens of one rank class, with the stack they read."""

    stack: RankClassStack
    index: LoraIndex
    modules: frozenset[str]  # projections any of these tokens' adapters target
    workspace: torch.Tensor  # [max_tokens * rank] fp32 shrink output on CUDA, empty on CPU
    native: bool = False  # CPU: kernels.native's lora_bgmv may serve (the manager's probe passed)
    groups: dict[str, list[LoraGroup]] = field(init=False)  # group -> per layer, the targeted members' weights

    def __post_init__(self) -> None:
        self.groups = {}
        for name, members in GROUPS.items():
            targeted = tuple(m for m in members if m in self.modules)
            if targeted:
                self.groups[name] = self.stack.group(name, targeted)


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
