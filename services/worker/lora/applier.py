"""The per-step LoRA hook the engine calls after each projection (engine/lora_hook.py's LoraHook)."""

from dataclasses import dataclass

import torch

from kernels import LoraIndex, add_lora
from services.worker.lora.slots import RankClassStack


@dataclass(slots=True)
class ClassBatch:
    """The step's tokens of one rank class, with the stack they read."""

    stack: RankClassStack
    index: LoraIndex
    modules: frozenset[str]  # projections any of these tokens' adapters target
    workspace: torch.Tensor  # [max_tokens * rank] fp32 shrink output on CUDA, empty on CPU
    native: bool = False  # CPU: kernels.native's lora_bgmv may serve (the manager's probe passed)


class LoraBatch:
    """Adds each token's own adapter delta, one shrink / expand pair per rank class in use.

    A rank-8 adapter is computed against the rank-8 stack only; tokens of slot -1 and classes
    or projections no token of this step targets cost nothing.
    """

    __slots__ = ("classes", "modules")

    def __init__(self, classes: list[ClassBatch]):
        self.classes = classes
        self.modules: frozenset[str] = frozenset().union(*(part.modules for part in classes))

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(part.stack.rank for part in self.classes)

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += scale * (x @ A[slot]) @ B[slot] per token, in place. x: [num_tokens, in]; y: [num_tokens, out]."""
        for part in self.classes:
            if module in part.modules:
                stack = part.stack
                add_lora(
                    x,
                    y,
                    stack.a[layer][module],
                    stack.b[layer][module],
                    stack.scale,
                    part.index,
                    part.workspace,
                    part.native,
                )
