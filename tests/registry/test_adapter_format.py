"""Admission checks of adapter files: each refusal names exactly what is wrong."""

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.registry.push_admission import BaseModelIdentity
from shared.adapter_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterLimits,
    file_digests,
    read_adapter_dir,
    validate_adapter,
)
from shared.errors import IntegrityError, InvalidRequest, LorafleetError, PayloadTooLarge

LIMITS = AdapterLimits(max_rank=16, max_weights_bytes=1_000_000)
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def refused(files: dict[str, bytes], base: BaseModelIdentity, error: type[LorafleetError], text: str) -> None:
    with pytest.raises(error) as info:
        validate_adapter(files, base.spec, LIMITS)
    assert text in info.value.message


def test_peft_adapter_is_admitted_with_its_summary(adapter_files: dict[str, bytes], base: BaseModelIdentity) -> None:
    summary = validate_adapter(adapter_files, base.spec, LIMITS)
    assert (summary.rank, summary.alpha, summary.use_rslora) == (8, 16.0, False)
    assert summary.target_modules == ("q_proj", "v_proj")
    assert summary.tensor_count == 2 * 2 * 2  # layers x modules x (A, B)


def test_file_digests_are_each_files_sha256(adapter_files: dict[str, bytes]) -> None:
    digests = file_digests(adapter_files)
    assert set(digests) == {CONFIG_FILE, WEIGHTS_FILE}
    assert digests[WEIGHTS_FILE] == hashlib.sha256(adapter_files[WEIGHTS_FILE]).hexdigest() != digests[CONFIG_FILE]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("adapter_model.bin", "only adapter_model.safetensors"),
        ("model.pt", "only adapter_model.safetensors"),
        ("data.pkl", "only adapter_model.safetensors"),
        ("../adapter_config.json", "path components are not allowed"),
        ("sub/adapter_model.safetensors", "path components are not allowed"),
    ],
)
def test_unexpected_file_names_are_refused(
    adapter_files: dict[str, bytes], base: BaseModelIdentity, name: str, text: str
) -> None:
    refused({**adapter_files, name: b"\x80\x04K\x01."}, base, InvalidRequest, text)


@pytest.mark.parametrize(
    ("update", "text"),
    [
        ({"auto_map": {"AutoModel": "evil.Model"}}, "auto_map references remote code"),
        ({"auto_mapping": {"base_model_class": "X", "parent_library": "evil_pkg"}}, "custom class"),
        ({"use_dora": True}, "DoRA adapters (use_dora) are not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is refused"),
        ({"rank_pattern": {"(q|k)_proj": 4}}, "rank_pattern key '(q|k)_proj' is not served"),
        ({"r": 32}, "rank 32 exceeds the admitted maximum 16"),
        ({"peft_type": "IA3"}, "peft_type must be LORA"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules ['lm_head'] are refused"),
        ({"target_modules": ".*proj"}, "target_modules ['.*proj'] are refused"),
        ({"bias": "all"}, "bias='all' is refused"),
        ({"layer_replication": [[0, 1]]}, "unsupported setting layer_replication"),
    ],
)
def test_refused_configs(variant: Callable, base: BaseModelIdentity, update: dict, text: str) -> None:
    refused(variant(config=update), base, InvalidRequest, text)


def test_config_must_be_json(adapter_files: dict[str, bytes], base: BaseModelIdentity) -> None:
    refused({**adapter_files, CONFIG_FILE: b"{not json"}, base, InvalidRequest, "is not valid JSON")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(
    variant: Callable, base: BaseModelIdentity, dtype: torch.dtype, value: float
) -> None:
    def cast(tensors: dict[str, torch.Tensor]) -> None:
        for name in tensors:
            tensors[name] = tensors[name].to(dtype)

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        cast(tensors)
        tensors[Q_A][3, 5] = value

    validate_adapter(variant(tensors=cast), base.spec, LIMITS)  # finite in every dtype
    refused(variant(tensors=poison), base, IntegrityError, f"tensor {Q_A!r} contains NaN or Inf")


def test_trailing_bytes_after_the_tensors_are_refused(adapter_files: dict[str, bytes], base: BaseModelIdentity) -> None:
    files = {**adapter_files, WEIGHTS_FILE: adapter_files[WEIGHTS_FILE] + b"\x80\x04payload"}
    refused(files, base, IntegrityError, "trailing bytes after the tensors")


def test_shape_mismatch_with_the_base_model_is_refused(variant: Callable, base: BaseModelIdentity) -> None:
    def widen(tensors: dict[str, torch.Tensor]) -> None:
        tensors[Q_A] = torch.zeros(8, 96)

    refused(variant(tensors=widen), base, IntegrityError, "has shape (8, 96), expected (8, 64)")


def test_adapter_for_a_bigger_base_model_is_refused(adapter_files: dict[str, bytes], base: BaseModelIdentity) -> None:
    bigger = dataclasses.replace(base.spec, hidden_size=128)
    with pytest.raises(IntegrityError, match="expected"):
        validate_adapter(adapter_files, bigger, LIMITS)


def test_foreign_tensor_names_are_refused(variant: Callable, base: BaseModelIdentity) -> None:
    def smuggle(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = torch.zeros(128, 64)

    refused(variant(tensors=smuggle), base, IntegrityError, "'lm_head.weight' is not a LoRA A/B weight")


def test_unpaired_lora_a_is_refused(variant: Callable, base: BaseModelIdentity) -> None:
    refused(variant(tensors=lambda t: t.pop(Q_A.replace("lora_A", "lora_B"))), base, IntegrityError, "without its pair")


def test_oversized_weights_are_refused(adapter_files: dict[str, bytes], base: BaseModelIdentity) -> None:
    with pytest.raises(PayloadTooLarge, match="exceeds the 1000-byte cap"):
        validate_adapter(adapter_files, base.spec, AdapterLimits(max_rank=16, max_weights_bytes=1000))


def test_truncated_weights_are_refused(adapter_files: dict[str, bytes], base: BaseModelIdentity) -> None:
    files = {**adapter_files, WEIGHTS_FILE: adapter_files[WEIGHTS_FILE][:-100]}
    refused(files, base, IntegrityError, "out of bounds (truncated or corrupt)")


@pytest.mark.parametrize(
    ("header", "text"),
    [
        ({Q_A: 5}, "must be a JSON object"),
        (
            {
                Q_A: {"dtype": "F32", "shape": [8, 64], "data_offsets": "0-2048"},
                Q_A.replace("lora_A", "lora_B"): {"dtype": "F32", "shape": [64, 8], "data_offsets": [0, 2048]},
            },
            "data_offsets must be two integers",
        ),
        ({Q_A: {"dtype": "I64", "shape": [8, 64], "data_offsets": [0, 4096]}}, "has dtype 'I64'"),
        ([1, 2], "not a JSON object"),
    ],
)
def test_malformed_safetensors_headers_get_typed_errors(
    variant: Callable, base: BaseModelIdentity, header: object, text: str
) -> None:
    encoded = json.dumps(header).encode()
    weights = struct.pack("<Q", len(encoded)) + encoded + bytes(2048)
    files = variant(config={"target_modules": ["q_proj"]})
    refused({**files, WEIGHTS_FILE: weights}, base, IntegrityError, text)


def test_directory_with_a_pickle_file_is_refused(peft_adapter_dir: Path, tmp_path: Path) -> None:
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (tmp_path / name).write_bytes((peft_adapter_dir / name).read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(InvalidRequest, match=r"'pytorch_model\.bin' is refused"):
        read_adapter_dir(tmp_path)


def test_directory_with_a_symlink_is_refused(peft_adapter_dir: Path, tmp_path: Path) -> None:
    (tmp_path / CONFIG_FILE).write_bytes((peft_adapter_dir / CONFIG_FILE).read_bytes())
    os.symlink(peft_adapter_dir / WEIGHTS_FILE, tmp_path / WEIGHTS_FILE)
    with pytest.raises(InvalidRequest, match="not a symlink"):
        read_adapter_dir(tmp_path)


def test_peft_directory_reads_to_the_two_files(peft_adapter_dir: Path) -> None:
    assert (peft_adapter_dir / "README.md").exists()
    assert set(read_adapter_dir(peft_adapter_dir)) == {CONFIG_FILE, WEIGHTS_FILE}
    assert json.loads(read_adapter_dir(peft_adapter_dir)[CONFIG_FILE])["r"] == 8
