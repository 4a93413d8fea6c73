"""Engine-owned view of a transformers Llama-family model: shapes, rope and fused weights."""

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.experts import ExpertWeights
from services.worker.engine.families import Family, family_of, layer_windows
from services.worker.engine.prequant import PackedLinear, concat
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
    attn_softcap: float | None = None  # Gemma 2: attention scores -> tanh(s / cap) * cap
    final_softcap: float | None = None  # Gemma: logits -> tanh(l / cap) * cap
    norm_fp32: bool = False  # Gemma: norm weights hold (1 + w) in fp32 and every norm runs in fp32
    gelu_tanh: bool = False  # the MLP gates with gelu (tanh approximation), not silu

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
    input_norm: torch.Tensor  # [hidden]; fp32 (1 + w) where spec.norm_fp32, as every norm weight
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]; rows: q_proj, k_proj, v_proj
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o: torch.Tensor  # [hidden, q_size]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]: the norm before the MLP
    attn_out_norm: torch.Tensor | None  # [hidden]: Gemma's norm of the attention output
    mlp_out_norm: torch.Tensor | None  # [hidden]: Gemma's norm of the MLP output
    local_rope: bool  # this layer rotates by ModelWeights.rope_local (Gemma 3 sliding layers)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: per-head RMSNorm weight of q then k (Qwen3)
    window: int | None  # sliding-window attention span in tokens; None for global (or a window >= max_model_len)
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; rows: gate_proj, up_proj (None: experts only)
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor | None  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]
    experts: ExpertWeights | None = None  # a mixture-of-experts layer's router and experts (gate_up: the shared one)
    wide_qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None  # ([q_size], [kv_size]): OLMoE's q and k norms
    # a pre-quantized checkpoint's projections ("qkv", "o", "gate_up", "down"), whose weights above are meta
    packed: dict[str, PackedLinear] = field(default_factory=dict)


@dataclass(slots=True)
class ModelWeights:
    spec: ModelSpec
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied
    rope: torch.Tensor  # [max_model_len, 2, head_dim]: cos and the signed sin (rope.cos_sin_table)
    rope_local: torch.Tensor | None = None  # [max_model_len, 2, head_dim]: Gemma 3's sliding-layer rope
    lm_head_packed: PackedLinear | None = None  # a pre-quantized lm_head (lm_head then a meta tensor)


def _fuse(modules: list[torch.nn.Linear], dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate projections row-wise; rebind the modules' parameters as views of the result.

    Rebinding keeps the transformers model usable while the weights are held only once in memory.
    Pre-quantized projections (meta weights) give a meta tensor of the fused logical shape.
    """
    if modules[0].weight.is_meta:
        rows = sum(m.weight.shape[0] for m in modules)
        weight = torch.empty(rows, modules[0].weight.shape[1], dtype=dtype, device="meta")
        return weight, _fused_bias(modules, dtype, device)
    weight = torch.cat([m.weight.detach() for m in modules]).to(device=device, dtype=dtype).contiguous()
    bias = _fused_bias(modules, dtype, device)
    if weight.dtype == modules[0].weight.dtype and weight.device == modules[0].weight.device:
        start = 0
        for m in modules:
            rows = m.weight.shape[0]
            m.weight.data = weight[start : start + rows]
            if bias is not None and m.bias is not None:
                m.bias.data = bias[start : start + rows]
            start += rows
    return weight, bias


def _fused_bias(modules: list[torch.nn.Linear], dtype: torch.dtype, device: str) -> torch.Tensor | None:
    biases = [m.bias for m in modules]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [
            b.detach() if b is not None else torch.zeros(m.weight.shape[0], dtype=dtype, device=device)
            for m, b in zip(modules, biases, strict=True)
        ]
    ).to(device=device, dtype=dtype)


def _packed(
    modules: list[torch.nn.Linear], names: dict[int, str], packed: dict[str, PackedLinear]
) -> PackedLinear | None:
    """The fused pre-quantized projection of ``modules`` (None: they are plain)."""
    parts = [packed.get(names[id(m)]) for m in modules]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise UnsupportedQuantization(
            f"{', '.join(names[id(m)] for m in modules)}: only some are quantized, and the engine fuses them",
            param="model",
        )
    return concat([p for p in parts if p is not None])


def _return_freed_heap() -> None:
    """Hand the heap pages freed by fusing back to the OS (glibc keeps them otherwise).

    Fusing frees every q/k/v and gate/up tensor transformers allocated; they are mid-sized, so
    glibc serves and frees them from its arenas and keeps those pages: about 0.5x the weight
    bytes of a bf16 model stay resident for nothing. ``malloc_trim`` returns them. No-op off glibc.
    """
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own symbols: libc's where glibc
    if trim is not None:
        trim(0)


def _single(module: torch.nn.Linear, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = module.bias.detach().to(device=device, dtype=dtype) if module.bias is not None else None
    if module.weight.is_meta:  # pre-quantized
        return torch.empty(module.weight.shape, dtype=dtype, device="meta"), bias
    return module.weight.detach().to(device=device, dtype=dtype), bias


def spec_of(config: PreTrainedConfig, dtype: torch.dtype = torch.float32) -> ModelSpec:
    family = family_of(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    granite = family.multipliers
    scale = head_dim**-0.5
    if "query_pre_attn_scalar" in family.handled:
        scale = float(config.query_pre_attn_scalar) ** -0.5
    elif granite:
        scale = float(config.attention_multiplier)
    embed_mul = float(config.embedding_multiplier) if granite else 1.0
    if family.embed_scale:  # transformers rounds sqrt(hidden) to the model's dtype before multiplying
        embed_mul = float(torch.tensor(config.hidden_size**0.5, dtype=dtype))
    return ModelSpec(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        attention_scale=scale,
        embedding_multiplier=embed_mul,
        residual_multiplier=float(config.residual_multiplier) if granite else 1.0,
        logits_scaling=float(config.logits_scaling) if granite else 1.0,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if family.handled else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if family.handled else None,
        norm_fp32=family.norm_offset,
        gelu_tanh=family.activation == "gelu_pytorch_tanh",
    )


def _norm_weight(norm: Any, spec: ModelSpec, dtype: torch.dtype, device: str) -> torch.Tensor:
    weight: torch.Tensor = norm.weight.detach()
    if spec.norm_fp32:
        return (1.0 + weight.float()).to(device)
    return weight.to(device=device, dtype=dtype)


def _qk_norm(attn: Any, spec: ModelSpec, dtype: torch.dtype, device: str) -> torch.Tensor:
    """The per-head q_norm and k_norm weights [head_dim], repeated over the heads of q then k."""
    q = _norm_weight(attn.q_norm, spec, dtype, device).expand(spec.num_heads, spec.head_dim)
    k = _norm_weight(attn.k_norm, spec, dtype, device).expand(spec.num_kv_heads, spec.head_dim)
    return torch.cat([q, k]).contiguous()


def _experts(
    mlp: Any,
    family: Family,
    config: PreTrainedConfig,
    dtype: torch.dtype,
    device: str,
    packed: dict[str, PackedLinear],
    name: str,
) -> ExpertWeights:
    """A sparse MLP's router and its experts, as transformers holds them fused ([experts, 2 * inter, hidden]);
    a pre-quantized checkpoint's experts (``packed`` under ``{name}.experts.E.gate_proj`` etc.) as each
    expert's gate|up and down quantized weights, the fused tensors then meta."""
    moe = family.moe
    assert moe is not None
    experts = mlp.experts
    shared_gate = mlp.shared_expert_gate.weight.detach().to(device=device, dtype=dtype) if moe.shared_expert else None
    gate_up_quant = down_quant = None
    count = experts.gate_up_proj.shape[0]
    found = {
        (e, p): linear
        for e in range(count)
        for p in ("gate_proj", "up_proj", "down_proj")
        if (linear := packed.get(f"{name}.experts.{e}.{p}")) is not None
    }
    if found:
        if len(found) != 3 * count:
            raise UnsupportedQuantization(
                f"{name}.experts: {len(found)} of the {3 * count} expert projections are quantized; the engine "
                "serves all of a layer's experts quantized or none",
                param="model",
            )
        gate_up_quant = [concat([found[e, "gate_proj"], found[e, "up_proj"]]).quant(dtype) for e in range(count)]
        down_quant = [found[e, "down_proj"].quant(dtype) for e in range(count)]
    return ExpertWeights(
        router=mlp.gate.weight.detach().to(device=device, dtype=dtype),
        gate_up=_expert_tensor(experts.gate_up_proj, dtype, device),
        down=_expert_tensor(experts.down_proj, dtype, device),
        top_k=config.num_experts_per_tok,
        normalise=moe.always_normalise or bool(config.norm_topk_prob),
        fp32_weights=moe.fp32_weights,
        shared_gate=shared_gate,
        gate_up_quant=gate_up_quant,
        down_quant=down_quant,
    )


def _expert_tensor(tensor: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A fused expert tensor in ``dtype`` on ``device``; a meta one (pre-quantized) stays meta."""
    if tensor.is_meta:
        return torch.empty(tensor.shape, dtype=dtype, device="meta")
    return tensor.detach().to(device=device, dtype=dtype)


def load_weights(
    model: PreTrainedModel,
    dtype: torch.dtype,
    device: str,
    max_model_len: int,
    packed: dict[str, PackedLinear] | None = None,
) -> ModelWeights:
    """Take the tensors transformers loaded into the engine's layout; UnsupportedModel for a family
    (or a feature of one) the families table does not serve exactly. ``packed``: a pre-quantized
    checkpoint's projections by module name (loader.LoadedModel.packed)."""
    packed = packed or {}
    names = {id(m): n for n, m in model.named_modules()}
    config = model.config
    family = family_of(config)
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows(config, family)]
    spec = spec_of(config, dtype)
    types = getattr(config, "layer_types", None) or ["full_attention"] * spec.num_layers
    layers = []
    for layer, window, layer_type in zip(model.model.layers, windows, types, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        sparse = hasattr(mlp, "experts")  # sparse_layers families mix dense MLP layers in
        experts = _experts(mlp, family, config, dtype, device, packed, names[id(mlp)]) if sparse else None
        dense = mlp.shared_expert if experts is not None and experts.shared_gate is not None else mlp
        gate_up = gate_up_bias = down = down_bias = None
        groups: dict[str, list[torch.nn.Linear]] = {"o": [attn.o_proj]}
        if family.fused_projections:  # Phi-3: rows already q, k, v and gate, up
            qkv, qkv_bias = _single(attn.qkv_proj, dtype, device)
            gate_up, gate_up_bias = _single(mlp.gate_up_proj, dtype, device)
            groups |= {"qkv": [attn.qkv_proj], "gate_up": [mlp.gate_up_proj]}
        else:
            qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], dtype, device)
            groups["qkv"] = [attn.q_proj, attn.k_proj, attn.v_proj]
            if not sparse or dense is not mlp:
                gate_up, gate_up_bias = _fuse([dense.gate_proj, dense.up_proj], dtype, device)
                groups["gate_up"] = [dense.gate_proj, dense.up_proj]
        o, o_bias = _single(attn.o_proj, dtype, device)
        if not sparse or dense is not mlp:
            down, down_bias = _single(dense.down_proj, dtype, device)
            groups["down"] = [dense.down_proj]
        layer_packed = {k: p for k, modules in groups.items() if (p := _packed(modules, names, packed)) is not None}
        wide_qk_norm = None
        if family.wide_qk_norm:
            wide_qk_norm = (
                _norm_weight(attn.q_norm, spec, dtype, device),
                _norm_weight(attn.k_norm, spec, dtype, device),
            )
        sandwich = family.sandwich_norms
        pre_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
        layers.append(
            LayerWeights(
                input_norm=_norm_weight(layer.input_layernorm, spec, dtype, device),
                qkv=qkv,
                qkv_bias=qkv_bias,
                o=o,
                o_bias=o_bias,
                post_norm=_norm_weight(pre_mlp, spec, dtype, device),
                attn_out_norm=_norm_weight(layer.post_attention_layernorm, spec, dtype, device) if sandwich else None,
                mlp_out_norm=_norm_weight(layer.post_feedforward_layernorm, spec, dtype, device) if sandwich else None,
                local_rope=family.local_rope and layer_type == "sliding_attention",
                qk_norm=_qk_norm(attn, spec, dtype, device) if family.qk_norm else None,
                window=window,
                gate_up=gate_up,
                gate_up_bias=gate_up_bias,
                down=down,
                down_bias=down_bias,
                experts=experts,
                wide_qk_norm=wide_qk_norm,
                packed=layer_packed,
            )
        )
    embed = model.model.embed_tokens.weight.detach().to(device=device, dtype=dtype)
    head_module = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
    head = head_module.weight.detach()
    head_packed = _packed([head_module], names, packed)
    if head.is_meta:
        lm_head = torch.empty(head.shape, dtype=dtype, device="meta")
    elif head.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        lm_head = embed
    else:
        lm_head = head.to(device, dtype)
    inv_freq = inverse_frequencies(rope_parameters(config), spec.head_dim, max_model_len)
    rope_local = None
    if family.local_rope:
        local = inverse_frequencies(rope_parameters(config, "sliding_attention"), spec.head_dim, max_model_len)
        rope_local = cos_sin_table(local, max_model_len, dtype, device)
    weights = ModelWeights(
        spec=spec,
        embed=embed,
        layers=layers,
        final_norm=_norm_weight(model.model.norm, spec, dtype, device),
        lm_head=lm_head,
        rope=cos_sin_table(inv_freq, max_model_len, dtype, device),
        rope_local=rope_local,
        lm_head_packed=head_packed,
    )
    _return_freed_heap()
    return weights
