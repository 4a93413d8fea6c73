"""Placement by engine capability over the real bus: two workers of one base model, one announcing
LoRA limits (rank 8, q,v only) in its heartbeat; an adapter it cannot serve never reaches it, and with
only that worker left the adapter is answered 503 no-worker instead of failing on the worker."""

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import nats
import pytest

from bench.tiny_model import make_tiny_model
from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import request
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import AdapterRecordsReply, PromoteRequest
from tests.helpers.adapters import ALL_MODULES
from tests.scheduler.conftest import MODEL, wait_workers

KEY = "key-demo"
ADAPTERS = {  # name -> (rank, modules, whether the narrow worker can serve it)
    "qv-r8": (8, ("q_proj", "v_proj"), True),
    "qv-r16": (16, ("q_proj", "v_proj"), False),
    "all7-r8": (8, ALL_MODULES, False),
}


@dataclass
class Pair:
    stack: Stack
    nats: Server
    gateway_url: str


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    from transformers import LlamaForCausalLM

    from tests.helpers.adapters import make_peft_model

    root = tmp_path_factory.mktemp("pair")
    model_dir = make_tiny_model(root / MODEL)
    nats_server = start_nats(free_port(), root / "nats")
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps({KEY: "demo"}),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_LIVENESS_TIMEOUT_S": "3",
        "LF_NO_WORKER_GRACE_S": "2",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
    }
    stack = Stack(env, root / "logs")
    narrow = {
        "LF_WORKER_ID": "narrow",
        "LF_LORA__RANK_CLASSES": "[8]",
        "LF_LORA__TARGET_MODULES": '["q_proj","v_proj"]',
    }
    try:
        for name in ("registry", "scheduler", "gateway"):
            stack.start(name)
        stack.start("worker", narrow, key="narrow")
        stack.start("worker", {"LF_WORKER_ID": "wide"}, key="wide")
        base = LlamaForCausalLM.from_pretrained(model_dir)
        for seed, (name, (rank, modules, _)) in enumerate(ADAPTERS.items()):
            make_peft_model(base, rank=rank, target_modules=modules, seed=seed).save_pretrained(root / name)
        asyncio.run(wait_ready(nats_server.url, stack, ("registry", "scheduler", "gateway"), 120))

        async def publish() -> None:
            nc = await nats.connect(nats_server.url)
            for name in ADAPTERS:
                record = await push_adapter(
                    nc,
                    root / name,
                    adapter_id=name,
                    tenant_id="demo",
                    task_type="chat",
                    base_fingerprint=fingerprint_model_dir(model_dir),
                    who="test",
                )
                promote = PromoteRequest(adapter_id=name, version=record.version, traffic_percent=100, actor="test")
                await request(nc, subjects.registry("promote"), promote, AdapterRecordsReply, 10)
            await nc.close()

        asyncio.run(publish())
        asyncio.run(wait_workers(nats_server.url, {"narrow", "wide"}, 180))
        yield Pair(stack, nats_server, f"http://127.0.0.1:{port}")
    finally:
        stack.stop_all()
        redis.stop()
        nats_server.stop()


async def _chat(client: httpx.AsyncClient, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})


async def test_an_adapter_goes_only_to_workers_whose_engine_serves_its_rank_and_modules(pair: Pair) -> None:
    served: dict[str, set[str]] = {name: set() for name in ADAPTERS}
    async with httpx.AsyncClient(base_url=pair.gateway_url, timeout=60) as client:
        for _ in range(4):  # at once: the less loaded worker is the narrow one half the time
            responses = await asyncio.gather(*(_chat(client, name) for name in ADAPTERS for _ in range(2)))
            for name, response in zip([n for n in ADAPTERS for _ in range(2)], responses, strict=True):
                assert response.status_code == 200, response.text
                served[name].add(response.headers["x-lorafleet-worker"])
    assert served["qv-r16"] == {"wide"} and served["all7-r8"] == {"wide"}


async def test_with_only_a_narrow_worker_left_an_unservable_adapter_is_503_no_worker(pair: Pair) -> None:
    pair.stack.stop("wide")
    await asyncio.sleep(4)  # past the liveness timeout: the scheduler drops the wide worker
    async with httpx.AsyncClient(base_url=pair.gateway_url, timeout=60) as client:
        refused = await _chat(client, "qv-r16")
        served = await _chat(client, "qv-r8")
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "no_worker_available"
    assert "qv-r16" in refused.json()["error"]["message"]
    assert served.status_code == 200 and served.headers["x-lorafleet-worker"] == "narrow"
