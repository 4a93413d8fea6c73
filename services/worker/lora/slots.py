"""Preallocated stacked adapter weights, one row per slot, grouped by rank class.

A slot is a global id: the rank classes own consecutive id ranges, in rank order, so sorting
token slots also groups tokens by rank class. Slot -1 means the base model alone.
"""

import torch

from kernels import LoraGroup
from services.worker.engine.lora_hook import EXPERT_GROUPS, GROUPS
from services.worker.lora.layout import AdapterWeights, ModelShapes
from services.worker.lora.lora_config import LoraConfig
from shared.errors import IntegrityError, NoFreeSlot
from shared.lora_targets import EXPERT_MODULES


def _copies(module: str, copies: int) -> tuple[int, ...]:
    """The expert dimension of an expert module's stack; none for a dense one."""
    return (copies,) if module in EXPERT_MODULES else ()


class RankClassStack:
    """The stacked A / B weights and scales of one rank class; row r holds one adapter or zeros."""

    __slots__ = ("_flat", "_groups", "a", "b", "dims", "first_slot", "num_slots", "rank", "row_modules", "scale")

    def __init__(
        self,
        rank: int,
        num_slots: int,
        first_slot: int,
        shapes: ModelShapes,
        modules: tuple[str, ...],
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.rank = rank
        self.num_slots = num_slots
        self.first_slot = first_slot
        self.dims = shapes.layers
        # per layer, each of its slot modules: A [num_slots, in, rank], B [num_slots, rank, out]; an
        # expert module: A [num_slots, experts, in, rank], B [num_slots, experts, rank, out]
        self.a: list[dict[str, torch.Tensor]] = [
            {
                m: torch.zeros(num_slots, *_copies(m, c), i, rank, device=device, dtype=dtype)
                for m, (c, i, _) in layer.items()
                if m in modules
            }
            for layer in shapes.layers
        ]
        self.b: list[dict[str, torch.Tensor]] = [
            {
                m: torch.zeros(num_slots, *_copies(m, c), rank, o, device=device, dtype=dtype)
                for m, (c, _, o) in layer.items()
                if m in modules
            }
            for layer in shapes.layers
        ]
        self.scale = torch.zeros(num_slots, dtype=torch.float32, device=device)  # [num_slots]
        self.row_modules: list[frozenset[str]] = [frozenset()] * num_slots  # host: modules each row targets
        self._groups: dict[tuple[str, tuple[str, ...]], list[LoraGroup | None]] = {}
        self._flat: dict[tuple[str, tuple[str, ...]], tuple[list[torch.Tensor], tuple[int, ...]]] = {}

    def group(self, name: str, modules: tuple[str, ...]) -> list[LoraGroup | None]:
        """Per layer, the weights of ``modules`` (members of lora_hook.GROUPS[name], or of EXPERT_GROUPS'
        for ``experts.`` names, in its order) with their columns in the group's fused output, None on a
        layer without them (a mixture-of-experts layer's dense MLP); built once per (group, modules),
        the stacks are written in place so the views stay current."""
        key = (name, modules)
        groups = self._groups.get(key)
        if groups is None:
            members = EXPERT_GROUPS[name] if modules[0] in EXPERT_MODULES else GROUPS[name]
            groups = []
            for layer_a, layer_b, dims in zip(self.a, self.b, self.dims, strict=True):
                if not all(m in layer_a for m in modules):
                    groups.append(None)
                    continue
                cols, col = {}, 0
                for member in members:
                    cols[member] = col
                    col += dims[member][2]
                groups.append(
                    LoraGroup(
                        a=tuple(layer_a[m] for m in modules),
                        b=tuple(layer_b[m] for m in modules),
                        cols=tuple(cols[m] for m in modules),
                    )
                )
            self._groups[key] = groups
        return groups

    def flat_group(self, name: str, modules: tuple[str, ...]) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        """``group``'s weights as the native layer loop takes them (lora_hook.BgmvCalls): every layer's
        A of each module, layer-major, then as many B; and the modules' columns. Built once per key."""
        key = (name, modules)
        flat = self._flat.get(key)
        if flat is None:
            groups = [g for g in self.group(name, modules) if g is not None]
            assert len(groups) == len(self.a), "the native layer loop serves dense layers only"
            weights = [a for g in groups for a in g.a] + [b for g in groups for b in g.b]
            flat = self._flat[key] = (weights, groups[0].cols)
        return flat

    def set_slot(self, row: int, weights: AdapterWeights) -> None:
        """Copy an adapter into a row, zero-padded from its rank to the class rank."""
        self.reset_slot(row)
        r = weights.rank
        for (layer, module), a in weights.a.items():
            self.a[layer][module][row, ..., :r].copy_(a)
            self.b[layer][module][row, ..., :r, :].copy_(weights.b[(layer, module)])
        self.scale[row] = weights.scale
        self.row_modules[row] = weights.modules

    def reset_slot(self, row: int) -> None:
        """Zero a row, so a stale index into it adds nothing."""
        for layer_a, layer_b in zip(self.a, self.b, strict=True):
            for module in layer_a:
                layer_a[module][row].zero_()
                layer_b[module][row].zero_()
        self.scale[row] = 0.0
        self.row_modules[row] = frozenset()


class SlotPool:
    """All rank classes' stacks, sized from the byte budget, with their free rows."""

    __slots__ = ("_free", "classes", "max_rank", "slot_bytes")

    def __init__(self, config: LoraConfig, shapes: ModelShapes, device: torch.device | str, dtype: torch.dtype):
        modules = config.target_modules
        elem = torch.empty(0, dtype=dtype).element_size()
        classes, slot_bytes, first = [], [], 0
        for rank, budget in zip(config.rank_classes, config.class_budgets(), strict=True):
            size = rank * shapes.params_per_rank(modules) * elem
            count = min(config.max_slots_per_class, budget // size)
            if count < 1:
                raise ValueError(f"rank class {rank} gets {budget} bytes, less than one slot ({size} bytes)")
            classes.append(RankClassStack(rank, count, first, shapes, modules, torch.device(device), dtype))
            slot_bytes.append(size)
            first += count
        self.classes: tuple[RankClassStack, ...] = tuple(classes)
        self.slot_bytes: tuple[int, ...] = tuple(slot_bytes)
        self._free: list[list[int]] = [list(range(c.num_slots - 1, -1, -1)) for c in classes]  # popped low row first
        self.max_rank = config.rank_classes[-1]

    @property
    def num_slots(self) -> int:
        return sum(c.num_slots for c in self.classes)

    def class_of_rank(self, rank: int) -> int:
        """Index of the smallest rank class >= rank."""
        for i, stack in enumerate(self.classes):
            if rank <= stack.rank:
                return i
        raise IntegrityError(f"adapter rank {rank} is above the admitted maximum {self.max_rank}", param="r")

    def locate(self, slot: int) -> tuple[RankClassStack, int]:
        """The stack holding a global slot id, and its row there."""
        for stack in self.classes:
            if stack.first_slot <= slot < stack.first_slot + stack.num_slots:
                return stack, slot - stack.first_slot
        raise KeyError(f"no slot {slot}")

    def free_slots(self, rank: int) -> int:
        return len(self._free[self.class_of_rank(rank)])

    def can_allocate(self, rank: int) -> bool:
        return self.free_slots(rank) > 0

    def allocate(self, rank: int) -> int:
        """Take a free slot of the rank's class; raises NoFreeSlot when the class is full."""
        i = self.class_of_rank(rank)
        if not self._free[i]:
            raise NoFreeSlot(f"all {self.classes[i].num_slots} slots of rank class {self.classes[i].rank} are taken")
        return self.classes[i].first_slot + self._free[i].pop()

    def set_slot(self, slot: int, weights: AdapterWeights) -> None:
        stack, row = self.locate(slot)
        if weights.rank > stack.rank:
            raise IntegrityError(f"rank {weights.rank} does not fit slot {slot} of rank class {stack.rank}", param="r")
        stack.set_slot(row, weights)

    def release(self, slot: int) -> None:
        """Zero a slot and return it to its class's free rows."""
        stack, row = self.locate(slot)
        stack.reset_slot(row)
        self._free[self.classes.index(stack)].append(row)
