"""PEFT directories -> slot layout, and every refusal with its typed error."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.lora import MODULES, ModelShapes, load_peft_adapter
from shared.errors import IntegrityError
from tests.helpers.adapters import (
    ALL_MODULES,
    edit_adapter_config,
    make_peft_model,
    save_peft_adapter,
    tiny_llama,
    tiny_llama_config,
)

SHAPES = ModelShapes.from_hf_config(tiny_llama_config())
WEIGHTS = "adapter_model.safetensors"


def load(directory: Path, max_rank: int = 64, allowed: tuple[str, ...] = MODULES):
    return load_peft_adapter(directory, SHAPES, max_rank=max_rank, allowed_modules=allowed)


def rewrite_tensor(directory: Path, key_part: str, change) -> None:
    tensors = load_file(directory / WEIGHTS)
    key = next(k for k in tensors if key_part in k)
    tensors[key] = change(tensors[key])
    save_file(tensors, directory / WEIGHTS)


@pytest.fixture(scope="module")
def base():
    return tiny_llama()


@pytest.fixture
def adapter(tmp_path: Path, base) -> Path:
    modules = ("q_proj", "v_proj", "down_proj")
    return save_peft_adapter(tmp_path / "adapter", base, rank=8, alpha=16, target_modules=modules)


def test_loads_slot_layout_transposed_from_peft(tmp_path: Path, base) -> None:
    model = make_peft_model(base, rank=8, alpha=16, target_modules=ALL_MODULES)
    model.save_pretrained(tmp_path)
    weights = load(tmp_path)
    assert weights.rank == 8 and weights.scale == 2.0
    assert weights.modules == set(ALL_MODULES) and len(weights.a) == 2 * 7
    q = model.base_model.model.model.layers[1].self_attn.q_proj
    torch.testing.assert_close(weights.a[(1, "q_proj")], q.lora_A["default"].weight.t())
    torch.testing.assert_close(weights.b[(1, "q_proj")], q.lora_B["default"].weight.t())
    assert weights.a[(0, "down_proj")].shape == (128, 8) and weights.b[(0, "k_proj")].shape == (8, 32)


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path: Path, base) -> None:
    weights = load(save_peft_adapter(tmp_path, base, rank=16, alpha=8, use_rslora=True))
    assert math.isclose(weights.scale, 8 / 4)


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"use_dora": True}, "use_dora", "not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save", "not supported"),
        ({"rank_pattern": {"q_proj": 4}}, "alpha_pattern", "share one scale"),  # q_proj's scale 4, the rest 2
        ({"rank_pattern": {"(q|k)_proj": 4}}, "rank_pattern", "dotted module name"),  # regex syntax: not matched
        ({"bias": "all"}, "bias", "without bias"),
        ({"peft_type": "IA3"}, "peft_type", "not LORA"),
        ({"target_modules": ["q_proj", "lm_head"]}, "lm_head", "not served"),
        ({"r": 16}, None, "expected"),
        ({"r": 0}, "r", "positive"),
    ],
)
def test_config_refusals(adapter: Path, change: dict, param: str | None, message: str) -> None:
    edit_adapter_config(adapter, **change)
    with pytest.raises(IntegrityError, match=message) as err:
        load(adapter)
    assert param is None or err.value.param == param
    assert err.value.status == 422


def test_refuses_pickle_weights_even_beside_safetensors(adapter: Path) -> None:
    torch.save({}, adapter / "adapter_model.bin")
    with pytest.raises(IntegrityError, match="pickle"):
        load(adapter)


def test_refuses_a_directory_without_safetensors(adapter: Path) -> None:
    (adapter / WEIGHTS).unlink()
    with pytest.raises(IntegrityError, match="missing"):
        load(adapter)


def test_refuses_a_corrupt_safetensors_file(adapter: Path) -> None:
    (adapter / WEIGHTS).write_bytes(b"\x00" * 64)
    with pytest.raises(IntegrityError, match="safetensors"):
        load(adapter)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refuses_non_finite_values(adapter: Path, bad: float) -> None:
    rewrite_tensor(adapter, "layers.1.self_attn.v_proj.lora_B", lambda t: t.index_fill(0, torch.tensor([3]), bad))
    with pytest.raises(IntegrityError, match="non-finite"):
        load(adapter)


def test_refuses_a_shape_that_does_not_match_the_base_model(adapter: Path) -> None:
    rewrite_tensor(adapter, "layers.0.self_attn.q_proj.lora_B", lambda t: t[:48].contiguous())
    with pytest.raises(IntegrityError, match=r"shape \(48, 8\), expected \(64, 8\)"):
        load(adapter)


def test_refuses_a_rank_above_the_admitted_maximum(tmp_path: Path, base) -> None:
    directory = save_peft_adapter(tmp_path, base, rank=32)
    with pytest.raises(IntegrityError, match="rank 32 is above the admitted maximum 16") as err:
        load(directory, max_rank=16)
    assert err.value.param == "r"


def test_refuses_a_module_the_slots_do_not_serve(adapter: Path, tmp_path: Path, base) -> None:
    with pytest.raises(IntegrityError, match="not served") as err:
        load(adapter, allowed=("q_proj", "v_proj"))
    assert err.value.param == "down_proj"
    embed = save_peft_adapter(tmp_path / "embed", base, target_modules=("q_proj", "embed_tokens"))
    with pytest.raises(IntegrityError, match="embed_tokens"):
        load(embed)


def test_refuses_a_half_pair(adapter: Path) -> None:
    tensors = load_file(adapter / WEIGHTS)
    del tensors[next(k for k in tensors if "layers.0.mlp.down_proj.lora_A" in k)]
    save_file(tensors, adapter / WEIGHTS)
    with pytest.raises(IntegrityError, match="lacks its lora_A or lora_B"):
        load(adapter)
