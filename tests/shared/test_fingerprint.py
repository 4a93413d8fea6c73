"""Base-model fingerprint: stable for the same weights, different for any other layout or content."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared import fingerprint
from shared.base_model import resolve_model_dir
from shared.errors import IntegrityError
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


def test_same_weights_same_fingerprint(tmp_path: Path) -> None:
    a = fingerprint_model_dir(model_dir(tmp_path / "a"))
    assert a == fingerprint_model_dir(model_dir(tmp_path / "b"))
    assert len(a) == 64


def test_equal_shapes_different_weights_differ(tmp_path: Path) -> None:
    """Two fine-tunes of one architecture: an adapter registered for one is refused on the other."""
    a = fingerprint_model_dir(model_dir(tmp_path / "a"))
    b = fingerprint_model_dir(model_dir(tmp_path / "b", fill=1.0))
    assert a != b
    c = model_dir(tmp_path / "c")
    tensors = load_file(c / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][17, 3] = 1e-3  # one element of one tensor
    save_file(tensors, c / "model.safetensors")
    assert fingerprint_model_dir(c) != a


def test_sharding_does_not_change_it(tmp_path: Path) -> None:
    whole = model_dir(tmp_path / "whole")
    sharded = model_dir(tmp_path / "sharded")
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    for i, (name, tensor) in enumerate(sorted(tensors.items())):
        save_file({name: tensor}, sharded / f"model-{i:05d}-of-00002.safetensors")
    assert fingerprint_model_dir(sharded) == fingerprint_model_dir(whole)


def test_cached_per_directory_and_recomputed_when_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LF_FINGERPRINT_CACHE", str(tmp_path / "cache"))
    directory = model_dir(tmp_path / "m")
    first = fingerprint_model_dir(directory)
    assert list((tmp_path / "cache").glob("*.json"))  # kept for the next process
    computed: list[Path] = []
    monkeypatch.setattr(fingerprint, "compute_fingerprint", lambda d: computed.append(d) or "0" * 64)
    fingerprint._memo.clear()
    assert fingerprint_model_dir(directory) == first  # from the disk cache: not recomputed
    assert computed == []
    tensors = load_file(directory / "model.safetensors")
    tensors["model.embed_tokens.weight"][0, 0] = 2.0
    save_file(tensors, directory / "model.safetensors")
    assert fingerprint_model_dir(directory) == "0" * 64  # the file changed: recomputed
    assert computed == [directory.resolve()]


def test_a_tensor_outside_the_file_is_refused(tmp_path: Path) -> None:
    directory = model_dir(tmp_path / "m")
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[: len(data) - 64])  # the last tensor cut short
    with pytest.raises(IntegrityError, match="outside the file"):
        fingerprint_model_dir(directory)


def test_any_architecture_or_tensor_change_changes_it(tmp_path: Path) -> None:
    reference = fingerprint_model_dir(model_dir(tmp_path / "ref"))
    assert fingerprint_model_dir(model_dir(tmp_path / "f16", dtype=torch.float16)) != reference
    assert fingerprint_model_dir(model_dir(tmp_path / "fill", fill=0.5)) != reference
    assert fingerprint_model_dir(model_dir(tmp_path / "vocab", {**CONFIG, "vocab_size": 33})) != reference
    assert fingerprint_model_dir(model_dir(tmp_path / "kv", {**CONFIG, "num_key_value_heads": 4})) != reference


def test_spec_defaults_follow_llama_conventions() -> None:
    spec = BaseModelSpec.from_config({k: v for k, v in CONFIG.items() if k != "num_key_value_heads"})
    assert (spec.num_kv_heads, spec.head_dim) == (4, 16)


def test_embedded_smollm2_fingerprint_is_stable() -> None:
    directory = resolve_model_dir(None)
    spec = BaseModelSpec.from_model_dir(directory)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (576, 30, 9, 3, 64)
    assert fingerprint_model_dir(directory) == fingerprint_model_dir(directory)
