"""The shipped example adapters: small, well-formed, and their eval sets held out from training."""

import importlib.util
import sys
from pathlib import Path

import pytest

from lorafleet.evaluation.runner import load_eval_set
from shared.adapter_format import WEIGHTS_FILE, read_adapter_dir
from shared.errors import InvalidRequest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ADAPTERS = sorted(p for p in (EXAMPLES.parent / "lorafleet" / "demo_adapters").iterdir() if p.is_dir())


def _train_script():
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("train_adapter", EXAMPLES / "train_adapter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_adapters_ship() -> None:
    assert {p.name for p in ADAPTERS} >= {"sql-employees", "json-extract", "capital-answer"}


@pytest.mark.parametrize("directory", ADAPTERS, ids=lambda p: p.name)
def test_adapter_is_small_and_admissible(directory: Path) -> None:
    assert (directory / "adapter" / WEIGHTS_FILE).stat().st_size < 2 * 1024 * 1024
    assert set(read_adapter_dir(directory / "adapter")) == {"adapter_config.json", WEIGHTS_FILE}


@pytest.mark.parametrize("directory", ADAPTERS, ids=lambda p: p.name)
def test_eval_set_is_held_out_from_training(directory: Path) -> None:
    train = _train_script()
    task = train.TASKS[directory.name]
    eval_set = load_eval_set(directory / "eval.jsonl")
    prompts = {item.messages[-1]["content"] for item in eval_set.items}
    assert 15 <= len(eval_set.items) <= 25 and len(prompts) == len(eval_set.items)
    assert 0 < eval_set.threshold <= 1
    assert prompts == {p for p, _ in train.eval_set(task)}
    assert not prompts & {p for p, _ in train.train_set(task, 80, prompts)}


def test_a_malformed_item_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text('{"meta": {"threshold": 0.5}}\n{"expected": "x", "scorer": "exact"}\n')
    with pytest.raises(InvalidRequest, match="exactly one of messages or prompt"):
        load_eval_set(path)
    path.write_text('{"prompt": "hi", "expected": "x", "scorer": "nope"}\n')
    with pytest.raises(InvalidRequest, match="unknown scorer"):
        load_eval_set(path)
