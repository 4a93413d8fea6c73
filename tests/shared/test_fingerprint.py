"""Base-model fingerprint: stable for the same weights layout, different for any other."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.base_model import resolve_model_dir
from shared.fingerprint import BaseModelSpec, fingerprint_model_dir

CONFIG = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 32,
}  # fmt: skip


def model_dir(path: Path, config: dict = CONFIG, dtype: torch.dtype = torch.float32, fill: float = 0.0) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    tensors = {
        "model.embed_tokens.weight": torch.full((config["vocab_size"], 64), fill, dtype=dtype),
        "model.layers.0.self_attn.q_proj.weight": torch.full((64, 64), fill, dtype=dtype),
    }
    save_file(tensors, path / "model.safetensors")
    return path


def test_same_layout_same_fingerprint_whatever_the_values(tmp_path: Path) -> None:
    a = fingerprint_model_dir(model_dir(tmp_path / "a"))
    assert a == fingerprint_model_dir(model_dir(tmp_path / "b", fill=1.0))
    assert len(a) == 64


def test_any_architecture_or_tensor_change_changes_it(tmp_path: Path) -> None:
    reference = fingerprint_model_dir(model_dir(tmp_path / "ref"))
    assert fingerprint_model_dir(model_dir(tmp_path / "f16", dtype=torch.float16)) != reference
    assert fingerprint_model_dir(model_dir(tmp_path / "vocab", {**CONFIG, "vocab_size": 33})) != reference
    assert fingerprint_model_dir(model_dir(tmp_path / "kv", {**CONFIG, "num_key_value_heads": 4})) != reference


def test_spec_defaults_follow_llama_conventions() -> None:
    spec = BaseModelSpec.from_config({k: v for k, v in CONFIG.items() if k != "num_key_value_heads"})
    assert (spec.num_kv_heads, spec.head_dim) == (4, 16)


def test_embedded_smollm2_fingerprint_reads_headers_only() -> None:
    directory = resolve_model_dir(None)
    spec = BaseModelSpec.from_model_dir(directory)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (576, 30, 9, 3, 64)
    assert fingerprint_model_dir(directory) == fingerprint_model_dir(directory)
