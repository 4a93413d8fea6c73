"""LF_WORKER_RANK_POOL: which of the worker's rank classes it declares as its pool."""

import pytest

from services.worker.settings import WorkerSettings


@pytest.mark.parametrize(
    "value, pool",
    [("", ()), ("high", (64,)), ("64", (64,)), ("64,32", (32, 64)), ("8,8", (8,))],
)
def test_the_declared_pool_is_a_set_of_the_workers_classes(monkeypatch: pytest.MonkeyPatch, value, pool):
    monkeypatch.setenv("LF_WORKER_RANK_POOL", value)
    settings = WorkerSettings()
    assert settings.rank_pool(settings.lora.rank_classes) == pool


def test_high_is_the_largest_of_the_configured_classes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("LF_WORKER_RANK_POOL", "high")
    monkeypatch.setenv("LF_LORA__RANK_CLASSES", "[8, 16]")
    settings = WorkerSettings()
    assert settings.rank_pool(settings.lora.rank_classes) == (16,)
