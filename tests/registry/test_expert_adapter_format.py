"""Admission of adapters on mixture-of-experts base models: PEFT's target_parameters on the fused
experts, per-expert modules and Qwen2-MoE's shared expert are accepted by shape (and their slot bytes
count every expert); wrong shapes, and modules the engine does not serve LoRA on, are refused."""

import copy
import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save
from transformers import PreTrainedModel

from services.registry.fleet_ranks import RankClasses
from services.registry.push_admission import _slot_bytes
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterLimits, read_adapter_dir, validate_adapter
from shared.errors import IntegrityError, InvalidRequest, UnservedTarget
from shared.fingerprint import BaseModelSpec
from shared.slot_size import params_per_rank
from tests.helpers.families import MOE_FAMILIES, QWEN2_MOE_DENSE_GATE

LIMITS = AdapterLimits(max_rank=16, max_weights_bytes=4_000_000)
QWEN2 = "qwen2-moe-shared-expert-dense-first"
PREFIX = "base_model.model.model.layers"


def _spec(model: PreTrainedModel) -> BaseModelSpec:
    return BaseModelSpec.from_config(model.config.to_dict())


def _peft_files(model: PreTrainedModel, root: Path, modules: list[str], parameters: list[str]) -> dict[str, bytes]:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=modules, target_parameters=parameters or None)
    get_peft_model(copy.deepcopy(model), config).save_pretrained(str(root))
    return read_adapter_dir(root, LIMITS)


def _files(tensors: dict[str, list[int]], modules: list[str], parameters: list[str] | None = None) -> dict[str, bytes]:
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": modules, "target_parameters": parameters}
    weights = save({f"{PREFIX}.{name}": torch.ones(shape) for name, shape in tensors.items()})
    return {CONFIG_FILE: json.dumps(config).encode(), WEIGHTS_FILE: weights}


def test_target_parameters_and_shared_expert_adapter_is_admitted_with_expert_bytes(tmp_path: Path) -> None:
    model = MOE_FAMILIES[QWEN2]()
    spec = _spec(model)
    modules = ["q_proj", *QWEN2_MOE_DENSE_GATE]
    files = _peft_files(model, tmp_path, modules, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    summary = validate_adapter(files, spec, LIMITS)
    assert summary.target_modules == (
        "experts.down_proj",
        "experts.gate_proj",
        "experts.up_proj",
        "gate_proj",
        "q_proj",
    )
    sizes = _slot_bytes(4, list(summary.target_modules), spec, RankClasses((8, 16), "test"), 4)
    e, h, i, shared, dense = 6, 64, 40, 56, 96  # layer 0 dense, layer 1 sparse with a shared expert
    per_rank = 2 * (h + h) + (h + dense) + (h + shared) + e * 2 * (h + i) + e * (h + i)
    assert sizes == {"8": 8 * per_rank * 4, "16": 16 * per_rank * 4}


def test_per_expert_module_adapter_is_admitted() -> None:
    tensors = {
        "1.block_sparse_moe.experts.3.w1.lora_A.weight": [4, 64],
        "1.block_sparse_moe.experts.3.w1.lora_B.weight": [96, 4],
    }
    summary = validate_adapter(_files(tensors, ["w1"]), _spec(MOE_FAMILIES["mixtral-window-8"]()), LIMITS)
    assert summary.target_modules == ("experts.gate_proj",)


@pytest.mark.parametrize(
    ("tensors", "error", "text"),
    [
        ({"1.mlp.experts.lora_A.weight": [24, 64], "1.mlp.experts.lora_B.weight": [64, 24]}, IntegrityError,
         "fit neither experts.gate_up_proj"),
        ({"1.mlp.experts.0.gate_proj.lora_A.weight": [4, 64], "1.mlp.experts.0.gate_proj.lora_B.weight": [96, 4]},
         IntegrityError, "expected (40, 4)"),
        ({"1.mlp.shared_expert.gate_proj.lora_A.weight": [4, 64],
          "1.mlp.shared_expert.gate_proj.lora_B.weight": [96, 4]}, IntegrityError, "expected (56, 4)"),
        ({"1.mlp.gate_proj.lora_A.weight": [4, 64], "1.mlp.gate_proj.lora_B.weight": [96, 4]}, UnservedTarget,
         "mixture-of-experts MLP"),  # a dense-MLP adapter on a sparse layer: what the registry used to admit
        ({"1.mlp.gate.lora_A.weight": [4, 64], "1.mlp.gate.lora_B.weight": [6, 4]}, UnservedTarget,
         "mixture-of-experts module"),  # the router
    ],
)  # fmt: skip
def test_expert_adapters_of_the_wrong_shape_or_module_are_refused(
    tensors: dict[str, list[int]], error: type[IntegrityError], text: str
) -> None:
    modules = sorted({name.split(".")[-3] for name in tensors} - {"experts", "gate"}) or ["q_proj"]
    files = _files(tensors, modules, ["mlp.experts.down_proj"])
    with pytest.raises(error) as info:
        validate_adapter(files, _spec(MOE_FAMILIES[QWEN2]()), LIMITS)
    assert text in info.value.message


def test_an_adapter_for_another_expert_width_is_refused(tmp_path: Path) -> None:
    files = _peft_files(MOE_FAMILIES[QWEN2](), tmp_path, ["q_proj"], ["mlp.experts.down_proj"])
    other = _spec(MOE_FAMILIES["mixtral-window-8"]())  # the same attention, experts 96 wide, not 40
    with pytest.raises(IntegrityError, match="fit neither"):
        validate_adapter(files, other, LIMITS)


def test_target_parameters_outside_the_experts_are_refused() -> None:
    files = _files({"1.mlp.experts.0.gate_proj.lora_A.weight": [4, 64]}, ["gate_proj"])
    config = json.loads(files[CONFIG_FILE]) | {"target_parameters": ["mlp.gate.weight"]}
    files[CONFIG_FILE] = json.dumps(config).encode()
    with pytest.raises(Exception, match="target_parameters"):
        validate_adapter(files, _spec(MOE_FAMILIES[QWEN2]()), LIMITS)


SHARED_GATE = {
    "1.mlp.shared_expert.gate_proj.lora_A.weight": [4, 64],
    "1.mlp.shared_expert.gate_proj.lora_B.weight": [56, 4],
}


def test_a_path_qualified_target_entry_matches_module_paths_by_suffix_as_peft_does() -> None:
    spec = _spec(MOE_FAMILIES[QWEN2]())
    assert validate_adapter(_files(SHARED_GATE, ["shared_expert.gate_proj"]), spec, LIMITS).target_modules == (
        "gate_proj",
    )
    with pytest.raises(IntegrityError, match="outside target_modules"):  # layer 1's shared expert is not mlp.gate_proj
        validate_adapter(_files(SHARED_GATE, ["mlp.gate_proj"]), spec, LIMITS)
    with pytest.raises(InvalidRequest, match="are refused"):
        validate_adapter(_files(SHARED_GATE, ["shared_expert.gate"]), spec, LIMITS)


def test_peft_s_bare_mlp_names_on_an_moe_model_are_admitted_at_their_largest_rank(tmp_path: Path) -> None:
    """PEFT >= 0.22 also puts bare MLP names on the routed experts' fused tensors, gate_up_proj at twice
    the rank and alpha (a rank_pattern / alpha_pattern, one scale): held at rank 2r, the rest zero-padded."""
    model = MOE_FAMILIES[QWEN2]()
    spec = _spec(model)
    files = _peft_files(model, tmp_path, ["gate_proj", "up_proj", "down_proj"], [])
    assert json.loads(files[CONFIG_FILE])["rank_pattern"] == {".*\\.gate_up_proj": 8}
    summary = validate_adapter(files, spec, LIMITS)
    assert (summary.rank, summary.alpha) == (8, 16.0)  # r=4, lora_alpha=8: scale 2 kept
    assert summary.target_modules == (
        "down_proj", "experts.down_proj", "experts.gate_proj", "experts.up_proj", "gate_proj", "up_proj"
    )  # fmt: skip
    sizes = _slot_bytes(summary.rank, list(summary.target_modules), spec, RankClasses((8, 16), "test"), 4)
    assert sizes == {"8": 8 * 4 * params_per_rank(spec.layer_dims(), summary.target_modules), "16": sizes["16"]}


@pytest.mark.parametrize(
    ("patterns", "text"),
    [
        ({"rank_pattern": {"(a+)+$": 8}}, "is not served: a dotted module name"),  # a regex that backtracks
        ({"rank_pattern": {"q_proj": 64}}, "exceeds the admitted maximum"),
        ({"rank_pattern": {"q_proj": 8}}, "must share one scale"),  # rank 8, alpha 8: scale 1, not 2
        ({"rank_pattern": {"q_proj": 8}, "use_rslora": True}, "use_rslora"),
        ({"alpha_pattern": {"q_proj": 0}}, "must be a positive float"),
    ],
)
def test_a_rank_pattern_that_cannot_be_served_exactly_is_refused(tmp_path: Path, patterns: dict, text: str) -> None:
    model = MOE_FAMILIES[QWEN2]()
    files = _peft_files(model, tmp_path, ["q_proj"], [])
    files[CONFIG_FILE] = json.dumps(json.loads(files[CONFIG_FILE]) | patterns).encode()
    with pytest.raises((InvalidRequest, IntegrityError), match=text):
        validate_adapter(files, _spec(model), LIMITS)


def test_a_bare_target_parameters_name_peft_wrote_is_admitted_and_a_non_expert_one_refused(tmp_path: Path) -> None:
    """PEFT >= 0.22 turns Mixtral's target_modules "w2" into target_parameters ["down_proj"]: the experts'."""
    model = MOE_FAMILIES["mixtral-window-8"]()
    files = _peft_files(model, tmp_path, ["q_proj", "w2"], [])
    assert json.loads(files[CONFIG_FILE])["target_parameters"] == ["down_proj"]
    assert validate_adapter(files, _spec(model), LIMITS).target_modules == ("experts.down_proj", "q_proj")
    config = json.loads(files[CONFIG_FILE]) | {"target_parameters": ["mlp.down_proj"]}  # a dense name: no expert
    files[CONFIG_FILE] = json.dumps(config).encode()
    with pytest.raises(InvalidRequest, match="target_parameters"):
        validate_adapter(files, _spec(model), LIMITS)
