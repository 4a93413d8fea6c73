"""A fleet of real processes on a tiny random Llama: NATS, Redis, registry, scheduler, gateway and
three workers, so scheduling is tested end to end in seconds."""

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import connect, decode
from shared.schemas import WorkerHeartbeat

MODEL = "tiny-llama"
KEYS = {"key-demo": "demo", "key-other": "other", "key-limited": "limited"}
WORKERS = ("w1", "w2", "w3")


async def wait_workers(nats_url: str, workers: set[str], timeout_s: float) -> None:
    nc = await connect(nats_url, "test-fleet")
    seen: set[str] = set()

    async def on_beat(msg) -> None:
        beat = decode(WorkerHeartbeat, msg.data)
        if beat.ready:
            seen.add(beat.worker_id)

    await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=on_beat)
    deadline = time.monotonic() + timeout_s
    try:
        while not workers <= seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready: {sorted(workers - seen)}")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


@dataclass
class Fleet:
    stack: Stack
    nats: Server
    redis: Server
    gateway_url: str
    model_dir: Path

    def start_scheduler(self) -> None:
        self.stack.start("scheduler")
        asyncio.run(wait_ready(self.nats.url, self.stack, ("scheduler",), 60))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    model_dir = make_tiny_model(root / MODEL)
    nats = start_nats(free_port(), root / "nats")
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps(KEYS),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_LIVENESS_TIMEOUT_S": "3",
        "LF_ACCEPT_TIMEOUT_S": "30",
        "LF_NO_WORKER_GRACE_S": "10",
        "LF_CAPACITY_HEADROOM": "0",
        "LF_ENGINE__MAX_NUM_SEQS": "2",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
        "LF_HEAT_DECAY_INTERVAL_S": "1",
        # scheduling under floods, not quotas, is tested here: the platform defaults would refuse them
        "LF_DEFAULT_QUOTA__REQUESTS_PER_MIN": "0",
        "LF_DEFAULT_QUOTA__TOKENS_PER_MIN": "0",
        "LF_DEFAULT_QUOTA__MAX_CONCURRENT": "0",
        "LF_SHED_OVERLOAD": "false",  # nor load shedding: a test turns it on where it is the subject
    }
    stack = Stack(env, root / "logs")
    running = Fleet(stack, nats, redis, f"http://127.0.0.1:{port}", model_dir)
    try:
        for name in ("registry", "scheduler", "gateway"):
            stack.start(name)
        for worker in WORKERS:
            stack.start("worker", {"LF_WORKER_ID": worker}, key=worker)
        asyncio.run(wait_ready(nats.url, stack, ("registry", "scheduler", "gateway"), 120))
        asyncio.run(wait_workers(nats.url, set(WORKERS), 180))
        yield running
    finally:
        stack.stop_all()
        redis.stop()
        nats.stop()


@pytest.fixture
async def world(redis_url):
    """The dispatcher and upkeep over a real Redis, no capacity headroom (a module may define its own)."""
    from services.scheduler.settings import SchedulerSettings
    from shared.redis_conn import connect_redis
    from tests.scheduler.test_dispatcher import World

    redis = connect_redis(redis_url)
    settings = SchedulerSettings(capacity_headroom=0, liveness_timeout_s=5, redis_key_prefix=f"w{time.monotonic_ns()}:")
    yield World(settings, redis)
    await redis.aclose()
