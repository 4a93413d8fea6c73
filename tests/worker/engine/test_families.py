"""The families table: every model_type outside it, and every unimplemented feature, is refused in one line."""

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import (
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    GptOssConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from services.worker.engine.errors import UnsupportedModel
from services.worker.engine.families import family_of, layer_windows
from services.worker.engine.model_loader import load_model

TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _with(config: PretrainedConfig, **keys: object) -> PretrainedConfig:
    """A config carrying keys its class does not declare, as a checkpoint's config.json can."""
    for key, value in keys.items():
        setattr(config, key, value)
    return config


REFUSED = [
    pytest.param(GemmaConfig(**TINY), r"model_type 'gemma' is not supported", id="gemma-1"),
    pytest.param(
        Gemma2Config(**TINY, hidden_activation="gelu"),
        r"'gemma2': activation hidden_activation='gelu'",
        id="gemma2-activation-key",
    ),
    pytest.param(
        Gemma3TextConfig(**TINY, use_bidirectional_attention=True),
        r"'gemma3_text': config key use_bidirectional_attention=True",
        id="gemma3-bidirectional",
    ),
    pytest.param(
        Phi3Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}),
        r"'phi3': partial rotary embedding \(partial_rotary_factor=0.75\)",
        id="phi3-partial-rotary",
    ),
    pytest.param(
        Phi3Config(
            **TINY,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 64,
            },
        ),
        r"'phi3': rope type 'longrope'",
        id="phi3-longrope",
    ),
    pytest.param(DeepseekV3Config(**TINY), r"'deepseek_v3': multi-head latent attention \(MLA\)", id="deepseek-v3-mla"),
    pytest.param(GptOssConfig(**TINY), r"'gpt_oss': attention sinks", id="gpt-oss-sinks"),
    pytest.param(
        _with(Qwen3MoeConfig(**TINY), n_routed_experts=8),
        r"'qwen3_moe': mixture-of-experts \(n_routed_experts=8\)",
        id="moe-key-the-family-does-not-read",
    ),
    pytest.param(
        MixtralConfig(**TINY, num_local_experts=2, num_experts_per_tok=3),
        r"'mixtral': routing 3 of 2 experts",
        id="top-k-above-experts",
    ),
    pytest.param(
        _with(LlamaConfig(**TINY), num_local_experts=4),
        r"'llama': mixture-of-experts \(num_local_experts=4\)",
        id="moe-key",
    ),
    pytest.param(LlamaConfig(**TINY, hidden_act="gelu"), r"'llama': activation hidden_act='gelu'", id="activation"),
    pytest.param(
        LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
        r"'llama': rope type 'yarn'",
        id="rope-yarn",
    ),
    pytest.param(
        _with(LlamaConfig(**TINY), final_logit_softcapping=30.0),
        r"'llama': config key final_logit_softcapping=30.0",
        id="math-key",
    ),
    pytest.param(
        _with(MistralConfig(**TINY), embedding_multiplier=12.0),
        r"'mistral': config key embedding_multiplier=12.0",
        id="granite-key-on-mistral",
    ),
]


@pytest.mark.parametrize(("config", "message"), REFUSED)
def test_unsupported_config_is_refused_in_one_line(config: PretrainedConfig, message: str) -> None:
    with pytest.raises(UnsupportedModel, match=message) as info:
        family_of(config)
    assert "\n" not in str(info.value)
    assert info.value.code == "unsupported_model"


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(LlamaConfig(**TINY), id="llama"),
        pytest.param(MistralConfig(**TINY, sliding_window=4096), id="mistral-window-beyond-len"),
        pytest.param(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=8), id="qwen2-window-unused"),
        pytest.param(Qwen3Config(**TINY), id="qwen3"),
        pytest.param(GraniteConfig(**TINY), id="granite"),
        pytest.param(Gemma2Config(**TINY), id="gemma2"),
        pytest.param(Phi3Config(**TINY, pad_token_id=0), id="phi3"),
        pytest.param(Gemma3TextConfig(**TINY), id="gemma3"),
        pytest.param(MixtralConfig(**TINY, num_local_experts=4), id="mixtral"),
        pytest.param(Qwen2MoeConfig(**TINY, num_experts=4), id="qwen2-moe"),
        pytest.param(Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]), id="qwen3-moe"),
        pytest.param(OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2), id="olmoe"),
    ],
)
def test_supported_config_is_accepted(config: PretrainedConfig) -> None:
    assert family_of(config).model_type == config.model_type


@pytest.mark.parametrize(
    ("config", "windows"),
    [
        pytest.param(LlamaConfig(**TINY), [None, None], id="llama"),
        pytest.param(MistralConfig(**TINY, sliding_window=32), [32, 32], id="mistral-every-layer"),
        pytest.param(Qwen2Config(**TINY, use_sliding_window=False, sliding_window=32), [None, None], id="qwen2-off"),
        pytest.param(
            Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=1),
            [None, 32],
            id="qwen2-from-max-window-layers",
        ),
    ],
)
def test_layer_windows_follow_the_config(config: PretrainedConfig, windows: list[int | None]) -> None:
    assert layer_windows(config, family_of(config)) == windows


def test_refused_model_dir_loads_no_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Gemma2Config(**TINY, hidden_activation="gelu").save_pretrained(tmp_path)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were read for a refused model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", forbidden)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", forbidden)
    with pytest.raises(UnsupportedModel, match="'gemma2': activation"):
        load_model(str(tmp_path), dtype=torch.float32)
