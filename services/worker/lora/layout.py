"""The slot layout: the base model's projection shapes and an adapter's weights laid out for the slots."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from shared.slot_size import params_per_rank

Module = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODULES: tuple[Module, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """Layer count and (in_features, out_features) of each Llama projection."""

    num_layers: int
    dims: Mapping[str, tuple[int, int]]
    sparse_layers: frozenset[int] = frozenset()  # layers whose MLP is a mixture of experts: no dense gate/up/down

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShapes":
        """From a transformers Llama-family config (hidden_size, heads, kv heads, head_dim, intermediate_size)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        heads = config.num_attention_heads
        q, kv = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
        dims = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        return cls(num_layers=config.num_hidden_layers, dims=dims, sparse_layers=_sparse_layers(config))

    def params_per_rank(self, modules: tuple[str, ...]) -> int:
        """A and B elements of one rank unit over every layer: slot elements = rank * this."""
        return params_per_rank(self.num_layers, self.dims, modules)


def _sparse_layers(config: Any) -> frozenset[int]:
    """The layers transformers builds as a mixture of experts: every layer where the config has experts,
    but for Qwen-MoE's ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips."""
    if not getattr(config, "num_experts", None):
        return frozenset()
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    return frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter in slot layout, unpadded; (layer, module) pairs it does not target are absent."""

    rank: int
    scale: float  # alpha / rank, or alpha / sqrt(rank) for rsLoRA
    a: Mapping[tuple[int, str], torch.Tensor]  # (layer, module) -> [in, rank]
    b: Mapping[tuple[int, str], torch.Tensor]  # (layer, module) -> [rank, out]
    # sha256 of adapter_model.safetensors, as the signed record names it (StoreLoader); None: read from a
    # local directory, never verified against a record
    digest: str | None = None

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(module for _, module in self.a)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))
