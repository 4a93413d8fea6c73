"""The slot layout: the base model's projection shapes and an adapter's weights laid out for the slots."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from shared.fingerprint import BaseModelSpec
from shared.lora_targets import EXPERT_MODULES, LayerDims
from shared.slot_size import params_per_rank

Module = Literal[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts.gate_proj",
    "experts.up_proj",
    "experts.down_proj",
]
MODULES: tuple[Module, ...] = (*get_args(Module),)


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """Layer count, (in_features, out_features) of each dense Llama projection, and per layer the slot
    modules it has (shared.lora_targets: a mixture-of-experts layer's experts, its shared expert)."""

    num_layers: int
    dims: Mapping[str, tuple[int, int]]
    layers: tuple[LayerDims, ...] = ()  # per layer: module -> (copies, in, out); () = every layer dense

    def __post_init__(self) -> None:
        if not self.layers:
            dense = {m: (1, i, o) for m, (i, o) in self.dims.items()}
            object.__setattr__(self, "layers", (dense,) * self.num_layers)

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShapes":
        """From a transformers Llama-family or mixture-of-experts config."""
        spec = BaseModelSpec.from_config(config.to_dict())
        return cls(num_layers=spec.num_layers, dims=spec.projection_dims(), layers=tuple(spec.layer_dims()))

    @property
    def sparse_layers(self) -> frozenset[int]:
        """The layers whose MLP is a mixture of experts."""
        return frozenset(i for i, layer in enumerate(self.layers) if EXPERT_MODULES[0] in layer)

    def present(self, modules: tuple[str, ...]) -> list[str]:
        """Those of ``modules`` some layer of this model has (a dense model has no experts.*), in order."""
        return [m for m in modules if any(m in layer for layer in self.layers)]

    def params_per_rank(self, modules: tuple[str, ...]) -> int:
        """A and B elements of one rank unit over every layer: slot elements = rank * this."""
        return params_per_rank(self.layers, modules)


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter in slot layout, unpadded; (layer, module) pairs it does not target are absent."""

    rank: int
    scale: float  # alpha / rank, or alpha / sqrt(rank) for rsLoRA
    a: Mapping[tuple[int, str], torch.Tensor]  # (layer, module) -> [in, rank]; an expert module: [experts, in, rank]
    b: Mapping[tuple[int, str], torch.Tensor]  # (layer, module) -> [rank, out]; an expert module: [experts, rank, out]
    # sha256 of adapter_model.safetensors, as the signed record names it (StoreLoader); None: read from a
    # local directory, never verified against a record
    digest: str | None = None

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.a)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
