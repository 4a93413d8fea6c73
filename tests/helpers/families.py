"""Tiny random models of every served family, with the features that set each apart from Llama switched on."""

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
# Qwen2-MoE's plain-MLP gate_proj Linears (a dense first layer's, the shared expert's), named by path. Since PEFT
# 0.22 a bare "gate_proj" on a transformers-v5 MoE model also targets the routed experts' fused gate_up_proj
# tensor (and is refused without "up_proj"); a path-qualified name matches the same Linears on every PEFT version.
QWEN2_MOE_DENSE_GATE = ["mlp.gate_proj", "shared_expert.gate_proj"]
PROMPTS = [
    [5, 17, 42, 99, 3, 8, 250, 11, 7],
    [200, 2, 9],
    [33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
]


def _tiny(config_cls: type, model_cls: type, **kwargs: object) -> PreTrainedModel:
    torch.manual_seed(0)
    model: PreTrainedModel = model_cls(config_cls(**TINY, **kwargs)).eval()
    with torch.no_grad():  # norms start at 1 (Gemma: at 0); random ones show a misread norm form
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            if name.endswith("mlp.gate.weight"):  # a router initialised at zero ties every expert
                param.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None  # greedy references run their full length
    return model


def tiny_llama(vocab_size: int = 256) -> LlamaForCausalLM:
    """A plain seeded Llama (vocab 256, or a real tokenizer's size, hidden 64, 2 layers, 4 heads on 2
    KV heads) for tests of the engine's mechanics rather than a family's math."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).eval()


class NullTokenizer:
    """Decodes each id to one CJK character: an engine's detokeniser runs without a vocabulary."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


GEMMA: dict[str, Any] = {
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "final_logit_softcapping": 3.0,
    "initializer_range": 0.1,
}


FAMILIES: dict[str, Callable[[], PreTrainedModel]] = {
    "llama-head-dim": lambda: _tiny(LlamaConfig, LlamaForCausalLM, head_dim=32),
    "mistral-window-beyond-len": lambda: _tiny(MistralConfig, MistralForCausalLM, sliding_window=4096),
    "mistral-window-8": lambda: _tiny(MistralConfig, MistralForCausalLM, sliding_window=8),
    "qwen2-window-8-second-layer": lambda: _tiny(
        Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "qwen3-window-5": lambda: _tiny(
        Qwen3Config, Qwen3ForCausalLM, use_sliding_window=True, sliding_window=5, max_window_layers=0
    ),
    "qwen3-qk-norm": lambda: _tiny(Qwen3Config, Qwen3ForCausalLM, head_dim=24, attention_bias=True),
    "gemma2-window-8-softcaps": lambda: _tiny(
        Gemma2Config, Gemma2ForCausalLM, **GEMMA, attn_logit_softcapping=2.0, tie_word_embeddings=True
    ),
    "gemma3-window-8-local-rope": lambda: _tiny(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        **GEMMA,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
    ),
    "phi3-fused": lambda: _tiny(Phi3Config, Phi3ForCausalLM, pad_token_id=0),
    "phi3-window-8": lambda: _tiny(Phi3Config, Phi3ForCausalLM, pad_token_id=0, sliding_window=8),
    "granite-multipliers": lambda: _tiny(
        GraniteConfig,
        GraniteForCausalLM,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=2.0,
        initializer_range=0.1,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    ),
}


EXPERTS: dict[str, Any] = {"num_experts": 6, "num_experts_per_tok": 2}
QWEN_MOE: dict[str, Any] = {**EXPERTS, "moe_intermediate_size": 40}
MOE_FAMILIES: dict[str, Callable[[], PreTrainedModel]] = {
    "mixtral-window-8": lambda: _tiny(
        MixtralConfig, MixtralForCausalLM, num_local_experts=6, num_experts_per_tok=2, sliding_window=8
    ),
    "qwen2-moe-shared-expert-dense-first": lambda: _tiny(
        Qwen2MoeConfig, Qwen2MoeForCausalLM, **QWEN_MOE, shared_expert_intermediate_size=56, mlp_only_layers=[0]
    ),
    "qwen2-moe-sparse-step-2-normalised": lambda: _tiny(
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        **QWEN_MOE,
        shared_expert_intermediate_size=56,
        decoder_sparse_step=2,
        norm_topk_prob=True,
        qkv_bias=True,
    ),
    "qwen3-moe-qk-norm-normalised": lambda: _tiny(
        Qwen3MoeConfig, Qwen3MoeForCausalLM, **QWEN_MOE, head_dim=24, norm_topk_prob=True
    ),
    "qwen3-moe-top-1-window-5": lambda: _tiny(
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        **{**QWEN_MOE, "num_experts_per_tok": 1},
        use_sliding_window=True,
        sliding_window=5,
    ),
    "olmoe-wide-qk-norm": lambda: _tiny(OlmoeConfig, OlmoeForCausalLM, **EXPERTS, eos_token_id=None),
}

# MoE families whose every projection int4 groups of 32 divide (expert width 64, shared expert 96,
# Mixtral's and OLMoE's 96): pre-quantized checkpoints of them (tests/worker/engine/test_prequant_moe.py)
PREQUANT_MOE_FAMILIES: dict[str, Callable[[], PreTrainedModel]] = {
    "mixtral": lambda: _tiny(MixtralConfig, MixtralForCausalLM, num_local_experts=6, num_experts_per_tok=2),
    "qwen2-moe-shared-expert": lambda: _tiny(
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        **EXPERTS,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        mlp_only_layers=[0],
        qkv_bias=True,
    ),
    "qwen3-moe": lambda: _tiny(
        Qwen3MoeConfig, Qwen3MoeForCausalLM, **EXPERTS, moe_intermediate_size=64, head_dim=24, norm_topk_prob=True
    ),
    "olmoe": lambda: _tiny(OlmoeConfig, OlmoeForCausalLM, **EXPERTS, eos_token_id=None),
}


def word_tokenizer(vocab_size: int) -> "PreTrainedTokenizerFast":
    """A word-level tokenizer over "t0".."t{vocab_size - 1}": a real tokenizer that reads no model cache."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0")


def save_family(model: PreTrainedModel, directory: Path) -> Path:
    """``model`` saved as a model directory with a word-level tokenizer over its vocabulary ("t0".."tN"):
    loadable by ``load_model`` without reading the embedded model's cache."""
    model.save_pretrained(directory)
    word_tokenizer(model.config.vocab_size).save_pretrained(directory)
    return directory
