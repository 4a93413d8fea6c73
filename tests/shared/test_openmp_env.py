"""shared/openmp_env.py: GOMP_SPINCOUNT for the built-in engine's processes, an operator's own value kept,
the vLLM worker left on GNU OpenMP's default; the worker's entry module sets it before importing torch."""

import os
from pathlib import Path

import pytest

from shared.openmp_env import SPIN_COUNT, default_spin_count


def test_unset_becomes_the_spin_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("LF_WORKER_ENGINE", raising=False)
    default_spin_count()
    assert os.environ["GOMP_SPINCOUNT"] == str(SPIN_COUNT)


def test_an_operators_value_and_the_vllm_worker_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")
    default_spin_count()
    assert os.environ["GOMP_SPINCOUNT"] == "77"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("LF_WORKER_ENGINE", "vllm")
    default_spin_count()
    assert "GOMP_SPINCOUNT" not in os.environ


def test_the_worker_entry_sets_it_before_anything_imports_torch() -> None:
    source = (Path(__file__).parents[2] / "services/worker/__main__.py").read_text()
    call, first_import = source.index("default_spin_count()"), source.index("from services.worker")
    assert source.index("from shared.openmp_env import default_spin_count") < call < first_import
