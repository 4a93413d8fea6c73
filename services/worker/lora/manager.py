"""Resident adapters: name -> slot, loading into and unloading from the slot pool, per-step hooks."""

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.dispatch import use_native_lora
from services.worker.lora.applier import ClassBatch, LoraBatch
from services.worker.lora.graph import StaticLora
from services.worker.lora.layout import AdapterWeights, ModelShapes
from services.worker.lora.lora_config import LoraConfig
from services.worker.lora.metadata import LoraMetadata
from services.worker.lora.peft_loader import load_peft_adapter
from services.worker.lora.slots import SlotPool
from shared.errors import IntegrityError
from shared.lora_targets import EXPERT_MODULES


@dataclass(frozen=True, slots=True)
class RankClassStats:
    rank: int
    slots: int
    free: int
    slot_bytes: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    resident: dict[str, int]  # adapter name -> slot
    classes: tuple[RankClassStats, ...]

    @property
    def free_slots(self) -> int:
        return sum(c.free for c in self.classes)


class AdapterManager:
    """The engine's adapter_manager: slot_of() for admission, prepare() once per step.

    load_adapter / unload may run on another thread than the step loop; the caller must not unload
    an adapter that has requests in flight (its slot is zeroed and may be reused at once).
    """

    def __init__(
        self,
        config: LoraConfig,
        shapes: ModelShapes,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.shapes = shapes
        self.device = torch.device(device)
        self.pool = SlotPool(config, shapes, self.device, dtype)
        self.native = use_native_lora(config.cpu_kernel, self.device, dtype)
        first_slots = [c.first_slot for c in self.pool.classes] + [self.pool.num_slots]
        self._metadata = LoraMetadata.allocate(config.max_num_tokens, first_slots, self.device)
        on_cuda = self.device.type == "cuda"
        self._workspaces = [
            torch.empty(config.max_num_tokens * c.rank if on_cuda else 0, dtype=torch.float32, device=self.device)
            for c in self.pool.classes
        ]
        self._slots: dict[str, int] = {}
        self._lock = threading.Lock()

    def can_load(self, rank: int) -> bool:
        """Whether the smallest rank class >= rank has a free slot."""
        with self._lock:
            return self.pool.can_allocate(rank)

    def load_adapter(self, name: str, source: Path | str | AdapterWeights) -> int:
        """Make an adapter resident (a PEFT directory, or weights already in slot layout); its slot.

        Loading a resident name again returns its slot. Raises IntegrityError for an invalid adapter
        and NoFreeSlot when its rank class is full.
        """
        with self._lock:
            if name in self._slots:
                return self._slots[name]
        weights = source if isinstance(source, AdapterWeights) else self.read_adapter(source)
        self._check(weights)
        with self._lock:
            if name in self._slots:
                return self._slots[name]
            slot = self.pool.allocate(weights.rank)
        # The copy runs unlocked: no token can reference a slot before it is published below.
        try:
            self.pool.set_slot(slot, weights)
        except BaseException:
            with self._lock:
                self.pool.release(slot)
            raise
        with self._lock:
            if name in self._slots:  # a concurrent load of the same name won
                self.pool.release(slot)
                return self._slots[name]
            self._slots[name] = slot
            return slot

    def read_adapter(self, directory: Path | str) -> AdapterWeights:
        """Validate and read a PEFT directory against this pool's model, rank classes and modules."""
        return load_peft_adapter(
            directory, self.shapes, max_rank=self.config.max_rank, allowed_modules=self.config.target_modules
        )

    def unload(self, name: str) -> None:
        """Zero the adapter's slot and free it. Raises KeyError when the name is not resident."""
        with self._lock:
            slot = self._slots.pop(name)
            self.pool.release(slot)

    @property
    def rank_classes(self) -> tuple[int, ...]:
        return self.config.rank_classes

    def slot_of(self, adapter: str) -> int | None:
        return self._slots.get(adapter)

    def resident(self) -> dict[str, int]:
        with self._lock:
            return dict(self._slots)

    def stats(self) -> PoolStats:
        with self._lock:
            classes = tuple(
                RankClassStats(c.rank, c.num_slots, self.pool.free_slots(c.rank), size)
                for c, size in zip(self.pool.classes, self.pool.slot_bytes, strict=True)
            )
            return PoolStats(resident=dict(self._slots), classes=classes)

    def prepare(self, token_slots: torch.Tensor) -> LoraBatch | None:
        """The step's LoRA hook for token_slots ([num_tokens] int64, -1 = base); None if no token has an adapter.

        The hook views buffers the next prepare() refills: it is valid for one step.
        """
        indexes = self._metadata.fill(token_slots)
        classes = []
        for stack, index, workspace in zip(self.pool.classes, indexes, self._workspaces, strict=True):
            if index is not None:
                modules = frozenset().union(*(stack.row_modules[row] for _, _, row, _ in index.segments))
                classes.append(ClassBatch(stack, index, modules, workspace, self.native))
        return LoraBatch(classes) if classes else None

    def graph_hook(self, max_rows: int) -> StaticLora:
        """The CUDA-graph decode step's fixed-shape hook over this pool's stacks (lora/graph.py)."""
        return StaticLora(self.pool.classes, max_rows, self.device)

    def _check(self, weights: AdapterWeights) -> None:
        if weights.rank > self.config.max_rank:
            message = f"adapter rank {weights.rank} is above the admitted maximum {self.config.max_rank}"
            raise IntegrityError(message, param="r")
        if weights.a.keys() != weights.b.keys():
            raise IntegrityError("every (layer, module) needs both an A and a B matrix", param="weights")
        unknown = sorted(weights.modules - set(self.config.target_modules))
        if unknown:
            message = f"target modules {unknown} are not served {list(self.config.target_modules)}"
            raise IntegrityError(message, param=unknown[0])
        for (layer, module), a in weights.a.items():
            dims = self.shapes.layers[layer].get(module) if layer < self.shapes.num_layers else None
            b = weights.b[(layer, module)]
            if dims is None:
                raise IntegrityError(f"layer {layer} has no {module}", param=module)
            copies, in_f, out_f = dims
            experts = (copies,) if module in EXPERT_MODULES else ()
            if a.shape != (*experts, in_f, weights.rank) or b.shape != (*experts, weights.rank, out_f):
                raise IntegrityError(f"layer {layer} {module} weights do not fit the base model", param=module)
