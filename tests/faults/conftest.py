"""A small fleet of real processes for fault injection: NATS, Redis, registry, scheduler, auditor,
gateway and two workers on a tiny random Llama, plus one released adapter of tenant ``demo``."""

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from pydantic import BaseModel

from bench.tiny_model import make_tiny_model
from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import request
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import AdapterRecordsReply, PromoteRequest
from tests.scheduler.conftest import MODEL, wait_workers

KEYS = {"key-demo": "demo", "key-other": "other"}
WORKERS = ("w1", "w2")
SERVICES = ("registry", "scheduler", "auditor", "gateway")
ADAPTER = "sea"  # owned by tenant demo, private
REQUEST_TIMEOUT_S = 25  # the gateway's end-to-end bound of one request
# A sequence may be this long: a stream a test abandons asks for nearly all of it, so it outlasts the test's
# steps however fast the machine decodes (the tiny model runs thousands of tokens a second)
MAX_MODEL_LEN = 16384


@dataclass
class Fleet:
    stack: Stack
    nats: Server
    redis: Server
    gateway_url: str
    model_dir: Path
    db_path: Path

    def start(self, service: str) -> None:
        """Start a service again and wait until it reports ready."""
        self.stack.start(service)
        asyncio.run(wait_ready(self.nats.url, self.stack, (service,), 60))

    def ready(self, timeout_s: float = 60) -> None:
        """Every service and every worker reports ready on the bus."""
        asyncio.run(wait_ready(self.nats.url, self.stack, SERVICES, timeout_s))
        asyncio.run(wait_workers(self.nats.url, set(WORKERS), timeout_s))


def make_adapter(model_dir: Path, directory: Path, seed: int) -> Path:
    """A rank-8 PEFT adapter for the tiny model, saved as users ship it."""
    from transformers import LlamaForCausalLM

    from tests.helpers.adapters import make_peft_model

    make_peft_model(LlamaForCausalLM.from_pretrained(model_dir), rank=8, seed=seed).save_pretrained(directory)
    return directory


async def registry_call(nats_url: str, op: str, message: BaseModel) -> AdapterRecordsReply:
    """One adapter operation on the registry over NATS (``lf.registry.<op>``)."""
    nc = await nats.connect(nats_url)
    try:
        return await request(nc, subjects.registry(op), message, AdapterRecordsReply, 10)
    finally:
        await nc.close()


async def release(nats_url: str, model_dir: Path, directory: Path, adapter_id: str, tenant: str = "demo") -> int:
    """Push the adapter as its next version and promote it to production; the version."""
    nc = await nats.connect(nats_url)
    try:
        record = await push_adapter(
            nc,
            directory,
            adapter_id=adapter_id,
            tenant_id=tenant,
            task_type="chat",
            base_fingerprint=fingerprint_model_dir(model_dir),
            who="test",
        )
        await request(
            nc,
            subjects.registry("promote"),
            PromoteRequest(adapter_id=adapter_id, version=record.version, traffic_percent=100, actor="test"),
            AdapterRecordsReply,
            10,
        )
        return record.version
    finally:
        await nc.close()


@pytest.fixture(scope="package")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("faults")
    model_dir = make_tiny_model(root / MODEL, max_positions=MAX_MODEL_LEN)
    make_adapter(model_dir, root / ADAPTER, seed=3)
    nats_server = start_nats(free_port(), root / "nats", root / "nats.log")
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps(KEYS),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_DB_PATH": str(root / "audit.sqlite3"),
        "LF_LIVENESS_TIMEOUT_S": "3",
        "LF_ACCEPT_TIMEOUT_S": "10",
        "LF_NO_WORKER_GRACE_S": "5",
        "LF_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "LF_CAPACITY_HEADROOM": "0",
        "LF_ENGINE__MAX_NUM_SEQS": "4",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(32 * 2**20),  # 64 Ki tokens of the tiny model: four longest sequences
        "LF_ENGINE__MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "LF_ENGINE__MAX_NUM_BATCHED_TOKENS": str(MAX_MODEL_LEN),
        "LF_LORA__MAX_NUM_TOKENS": str(MAX_MODEL_LEN),
        "LF_MAX_TOKENS_LIMIT": str(MAX_MODEL_LEN),
        "LF_METRICS_PORT": "-1",
    }
    stack = Stack(env, root / "logs")
    running = Fleet(stack, nats_server, redis, f"http://127.0.0.1:{port}", model_dir, root / "audit.sqlite3")
    try:
        for name in SERVICES:  # the scheduler's /metrics on, for tests/faults/observe.py to scrape
            stack.start(name, {"LF_METRICS_PORT": "0"} if name == "scheduler" else None)
        for worker in WORKERS:
            stack.start("worker", {"LF_WORKER_ID": worker}, key=worker)
        running.ready(180)
        asyncio.run(release(nats_server.url, model_dir, root / ADAPTER, ADAPTER))
        yield running
    finally:
        stack.stop_all()
        redis.stop()
        nats_server.stop()
