"""Engine-owned view of a transformers Llama-family model: shapes, rope and fused weights."""

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from services.worker.engine.families import family_of, layer_windows
from services.worker.engine.rope import cos_sin_table, inverse_frequencies, rope_parameters


@dataclass(frozen=True, slots=True)
class ModelSpec:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    attention_scale: float  # multiplies q k^T: head_dim ** -0.5, or Granite's attention_multiplier
    embedding_multiplier: float = 1.0  # Granite: the embeddings are scaled by it
    residual_multiplier: float = 1.0  # Granite: each block's output is scaled by it before the residual add
    logits_scaling: float = 1.0  # Granite: the logits are divided by it

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.kv_size * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]; rows: q_proj, k_proj, v_proj
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: torch.Tensor  # [hidden, q_size]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: per-head RMSNorm weight of q then k (Qwen3)
    window: int | None  # sliding-window attention span in tokens; None for global (or a window >= max_model_len)
    gate_up: torch.Tensor  # [2 * intermediate, hidden]; rows: gate_proj, up_proj
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]


@dataclass(slots=True)
class ModelWeights:
    spec: ModelSpec
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope: torch.Tensor  # [max_model_len, 2, head_dim]


def _fuse(modules: list[torch.nn.Linear], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate projections row-wise; rebind the modules' parameters as views of the result.

    Rebinding keeps the transformers model usable while the weights are held only once in memory.
    """
    weight = torch.cat([m.weight.detach() for m in modules]).to(device=device, dtype=dtype).contiguous()
    biases = [m.bias for m in modules]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                for m, b in zip(modules, biases, strict=True)
            ]
        ).to(device=device, dtype=dtype)
    if weight.dtype == modules[0].weight.dtype and weight.device == modules[0].weight.device:
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[start : start + rows]
            if bias is not None and m.bias is not None:
                m.bias.data = bias[start : start + rows]
            start += rows
    return weight, bias


def _single(module: torch.nn.Linear, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = module.bias.detach().to(device=device, dtype=dtype) if module.bias is not None else None
    return module.weight.detach().to(device=device, dtype=dtype), bias


def spec_of(config: PreTrainedConfig) -> ModelSpec:
    family = family_of(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    granite = family.multipliers
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        attention_scale=float(config.attention_multiplier) if granite else head_dim**-0.5,
        embedding_multiplier=float(config.embedding_multiplier) if granite else 1.0,
        residual_multiplier=float(config.residual_multiplier) if granite else 1.0,
        logits_scaling=float(config.logits_scaling) if granite else 1.0,
    )


def _qk_norm(attn: Any, spec: ModelSpec, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Qwen3's per-head q_norm and k_norm weights [head_dim], repeated over the heads of q then k."""
    q = attn.q_norm.weight.detach().expand(spec.num_heads, spec.head_dim)
    k = attn.k_norm.weight.detach().expand(spec.num_kv_heads, spec.head_dim)
    return torch.cat([q, k]).to(device=device, dtype=dtype).contiguous()


def load_weights(model: PreTrainedModel, dtype: torch.dtype, device: str, max_model_len: int) -> ModelWeights:
    """Take the tensors transformers loaded into the engine's layout; UnsupportedModel for a family
    (or a feature of one) the families table does not serve exactly."""
    config = model.config
    family = family_of(config)
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows(config, family)]
    spec = spec_of(config)
    layers = []
    for layer, window in zip(model.model.layers, windows, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], dtype, device)
        gate_up, gate_up_bias = _fuse([mlp.gate_proj, mlp.up_proj], dtype, device)
        o, o_bias = _single(attn.o_proj, dtype, device)
        down, down_bias = _single(mlp.down_proj, dtype, device)
        layers.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight.detach().to(device=device, dtype=dtype),
                qkv=qkv,
                qkv_bias=qkv_bias,
                o=o,
                o_bias=o_bias,
                post_norm=layer.post_attention_layernorm.weight.detach().to(device=device, dtype=dtype),
                qk_norm=_qk_norm(attn, spec, dtype, device) if family.qk_norm else None,
                window=window,
                gate_up=gate_up,
                gate_up_bias=gate_up_bias,
                down=down,
                down_bias=down_bias,
            )
        )
    embed = model.model.embed_tokens.weight.detach().to(device=device, dtype=dtype)
    head = model.get_output_embeddings().weight.detach()  # type: ignore[no-untyped-call]  # unannotated in transformers
    lm_head = embed if head.data_ptr() == model.model.embed_tokens.weight.data_ptr() else head.to(device, dtype)
    inv_freq = inverse_frequencies(rope_parameters(config), spec.head_dim, max_model_len)
    return ModelWeights(
        spec=spec,
        embed=embed,
        layers=layers,
        final_norm=model.model.norm.weight.detach().to(device=device, dtype=dtype),
        lm_head=lm_head,
        rope=cos_sin_table(inv_freq, max_model_len, dtype, device),
    )
