"""The whole stack as real processes: nats-server, redis-server and the five services."""

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import SERVICES, Stack, wait_ready

API_KEY = "e2e-key-demo"
OTHER_KEY = "e2e-key-other"
METRICS_TOKEN = "e2e-metrics-token"


@dataclass
class RunningStack:
    stack: Stack
    nats: Server
    redis: Server
    gateway_url: str
    api_key: str
    db_path: Path
    spans_path: Path
    worker_metrics_port: int = 0  # the worker binds /metrics to 0.0.0.0 on this port (as in compose)
    # beyond loopback /metrics takes a bearer token (as in compose): what a scrape of the worker sends
    worker_metrics_headers: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {METRICS_TOKEN}"})

    def ready(self, services: tuple[str, ...] = SERVICES, timeout_s: float = 300) -> None:
        asyncio.run(wait_ready(self.nats.url, self.stack, services, timeout_s))


@contextlib.contextmanager
def stack_of(root: Path, service_env: dict[str, dict[str, str]] | None = None) -> Iterator[RunningStack]:
    """The stack under ``root``, each service with its ``service_env`` on top of the common environment."""
    nats = start_nats(free_port(), root / "nats")
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps({API_KEY: "demo", OTHER_KEY: "other"}),
        "LF_DB_PATH": str(root / "audit.sqlite3"),
        "LF_LIVENESS_TIMEOUT_S": "5",
        "LF_ACCEPT_TIMEOUT_S": "8",
        "LF_NO_WORKER_GRACE_S": "5",
        "LF_MODEL_CACHE": os.environ["LF_MODEL_CACHE"],
        "LF_TRACE_EXPORTER": f"file:{root / 'spans.jsonl'}",
        # the release controller judges a few live requests per step here, on complaints alone
        # (latency and cost of one CPU-bound worker say nothing of a version)
        "LF_RELEASE_MIN_SAMPLES": "6",
        "LF_RELEASE_GUARD_MIN_SAMPLES": "6",
        "LF_RELEASE_DWELL_S": "1",
        "LF_RELEASE_TICK_S": "0.5",
        "LF_RELEASE_MAX_LATENCY_RATIO": "100",
        "LF_RELEASE_MAX_COST_RATIO": "100",
    }
    stack = Stack(env, root / "logs")
    running = RunningStack(
        stack,
        nats,
        redis,
        f"http://127.0.0.1:{port}",
        API_KEY,
        root / "audit.sqlite3",
        root / "spans.jsonl",
        worker_metrics_port=free_port(),
    )
    own_env = dict(service_env or {})
    own_env["worker"] = {
        "LF_METRICS_HOST": "0.0.0.0",
        "LF_METRICS_PORT": str(running.worker_metrics_port),
        "LF_METRICS_TOKEN": METRICS_TOKEN,
        **own_env.get("worker", {}),
    }
    try:
        for name in SERVICES:
            stack.start(name, own_env.get(name))
        running.ready()
        yield running
    finally:
        stack.stop_all()
        redis.stop()
        nats.stop()


@pytest.fixture(scope="module")
def running_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    with stack_of(tmp_path_factory.mktemp("stack")) as running:
        yield running
