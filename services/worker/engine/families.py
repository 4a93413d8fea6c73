"""The base-model families the engine serves exactly, and the load-time check that refuses the rest.

Each supported ``model_type`` has one entry saying how it differs from Llama. A config that is not
in the table, or that sets a key which changes the math and its family does not implement, is
refused with one line naming the model type and the feature: nothing is treated as Llama by default.
"""

from dataclasses import dataclass
from typing import Any

from services.worker.engine.errors import UnsupportedModel
from services.worker.engine.rope import ROPE_TYPES, rope_parameters


@dataclass(frozen=True, slots=True)
class Moe:
    """How a mixture-of-experts family routes: softmax over the experts in fp32, the top ``num_experts_per_tok``."""

    always_normalise: bool = False  # Mixtral: top-k weights always renormalised (else norm_topk_prob says)
    fp32_weights: bool = False  # Mixtral: top-k weights stay fp32 (others cast them to the model dtype)
    shared_expert: bool = False  # Qwen2-MoE: a dense MLP beside the experts, scaled by sigmoid(shared_expert_gate)
    sparse_layers: bool = False  # decoder_sparse_step and mlp_only_layers leave some layers a dense MLP


@dataclass(frozen=True, slots=True)
class Family:
    """What one model_type changes relative to Llama (RMSNorm, SwiGLU, rope, separate q/k/v, gate/up)."""

    model_type: str
    activation_key: str = "hidden_act"  # the config key that names the MLP activation
    activation: str = "silu"
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before rope (Qwen3, Gemma 3)
    multipliers: bool = False  # Granite's embedding/residual/attention multipliers and logits_scaling
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32; folded into the weight at load
    sandwich_norms: bool = False  # attention and MLP outputs are normed before their residual adds
    embed_scale: bool = False  # embeddings * sqrt(hidden_size), the scale rounded to the dtype
    local_rope: bool = False  # sliding layers take rope_parameters["sliding_attention"] (Gemma 3)
    fused_projections: bool = False  # checkpoint holds qkv_proj and gate_up_proj, already in the engine's layout
    handled: frozenset[str] = frozenset()  # NEUTRAL keys this family implements
    sliding_window_key: str = "sliding_window"  # None when the family has no sliding-window attention
    per_layer_window: bool = False  # config.layer_types says which layers slide (else every layer does)
    moe: Moe | None = None  # the MLP is a routed mixture of experts (on every layer, or as sparse_layers says)
    wide_qk_norm: bool = False  # RMSNorm over all of q and all of k, before rope (OLMoE)


GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
GEMMA_KEYS = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"})
GEMMA: dict[str, Any] = {
    "activation_key": "hidden_activation",
    "activation": "gelu_pytorch_tanh",
    "norm_offset": True,
    "sandwich_norms": True,
    "embed_scale": True,
    "per_layer_window": True,
}
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2", per_layer_window=True),
        Family("qwen3", qk_norm=True, per_layer_window=True),
        Family("granite", multipliers=True, handled=frozenset(GRANITE_MULTIPLIERS)),
        Family("phi3", fused_projections=True),
        Family("gemma2", **GEMMA, handled=GEMMA_KEYS),
        Family("gemma3_text", **GEMMA, qk_norm=True, local_rope=True, handled=GEMMA_KEYS),
        Family("mixtral", moe=Moe(always_normalise=True, fp32_weights=True)),
        Family("qwen2_moe", per_layer_window=True, moe=Moe(shared_expert=True, sparse_layers=True)),
        Family("qwen3_moe", qk_norm=True, moe=Moe(sparse_layers=True)),
        Family("olmoe", wide_qk_norm=True, moe=Moe()),
    )
}
# Families often asked for that the engine does not serve, with what it lacks for them
REFUSED_FAMILIES = {
    "deepseek_v3": "multi-head latent attention (MLA) and grouped top-k routing",
    "deepseek_v2": "multi-head latent attention (MLA) and grouped top-k routing",
    "gpt_oss": "attention sinks and clamped SwiGLU experts with biases",
}

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")
ROUTED_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok")  # what a Moe family reads
# Keys that change the forward pass, each with the value at which it does not: a family that does not
# implement a key must see it at that value (or absent).
NEUTRAL: dict[str, object] = {
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "logits_scaling": 1.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "partial_rotary_factor": 1.0,
    "use_qk_norm": False,
    "qk_layernorm": False,
    "use_parallel_residual": False,
    "clip_qkv": None,
    "use_bidirectional_attention": False,
}


def _refuse(model_type: str, feature: str) -> UnsupportedModel:
    return UnsupportedModel(f"model_type {model_type!r}: {feature} is not supported by the engine", param="model")


def family_of(config: Any) -> Family:
    """The config's family, or UnsupportedModel naming the model_type and the first unsupported feature."""
    model_type = getattr(config, "model_type", None) or "unknown"
    family = FAMILIES.get(model_type)
    if model_type in REFUSED_FAMILIES:
        raise _refuse(model_type, REFUSED_FAMILIES[model_type])
    if family is None:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported by the engine (supported: {', '.join(FAMILIES)})",
            param="model",
        )
    for key in MOE_KEYS:
        if getattr(config, key, None) and (family.moe is None or key not in ROUTED_KEYS):
            raise _refuse(model_type, f"mixture-of-experts ({key}={getattr(config, key)})")
    if family.moe is not None:
        experts, top_k = getattr(config, "num_experts", 0) or 0, getattr(config, "num_experts_per_tok", 0) or 0
        if not 0 < top_k <= experts:
            raise _refuse(model_type, f"routing {top_k} of {experts} experts")
    act = getattr(config, family.activation_key, None)
    if act != family.activation:
        raise _refuse(model_type, f"activation {family.activation_key}={act!r}")
    for layer_type in sorted(set(getattr(config, "layer_types", None) or ["full_attention"])):
        rope = rope_parameters(config, layer_type)
        if rope["rope_type"] not in ROPE_TYPES:
            raise _refuse(model_type, f"rope type {rope['rope_type']!r}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise _refuse(
                model_type, f"partial rotary embedding (partial_rotary_factor={rope['partial_rotary_factor']})"
            )
    for key, neutral in NEUTRAL.items():
        value = getattr(config, key, neutral)
        if key not in family.handled and value not in (neutral, None):
            raise _refuse(model_type, f"config key {key}={value!r}")
    return family


def layer_windows(config: Any, family: Family) -> list[int | None]:
    """Each layer's sliding window in tokens (a token sees at most that many), None for global attention."""
    window = getattr(config, family.sliding_window_key, None)
    layers = config.num_hidden_layers
    if not window:
        return [None] * layers
    if family.per_layer_window:
        types = getattr(config, "layer_types", None) or ["full_attention"] * layers
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * layers
