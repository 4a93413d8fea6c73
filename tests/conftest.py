"""Fixtures: real nats-server and redis-server processes on free ports, the base model cache."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.cli.infra import Server, free_port, start_nats, start_redis

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("LF_MODEL_CACHE", str(REPO / ".lorafleet" / "models"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton picks interpreter or compiler when a kernel is decorated, i.e. at the first import of
# kernels/, which any test module may trigger: choose the CPU interpreter before all of them.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The embedded SmolLM2 as a safetensors directory (converted from its GGUF on first use)."""
    from shared.base_model import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_nats(free_port(), tmp_path_factory.mktemp("nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: Server) -> str:
    return nats_server.url


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_redis(free_port(), tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server: Server) -> str:
    return redis_server.url


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[Server]:
    """A nats-server of this test alone, for tests that restart or fill it."""
    server = start_nats(free_port(), tmp_path / "nats")
    yield server
    server.stop()
