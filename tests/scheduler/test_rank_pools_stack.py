"""Rank pools on a real stack: two workers of one tiny base model over real nats-server and
redis-server, one declaring the high rank class its pool (LF_WORKER_RANK_POOL=high). Rank-64
adapters are served there and rank-8 ones on the other worker; a burst that saturates the pool
spills to the other worker and is counted; a push of a rank no worker class holds is refused with
the reason; and the rank metric families are on the workers' and the scheduler's scrapes."""

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.tiny_model import make_tiny_model
from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import request
from shared.errors import RankNotServed
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import AdapterRecordsReply, GetAdapterRequest, PromoteRequest
from tests.scheduler.conftest import MODEL, wait_workers

KEY = "key-demo"
BIG = ("big0", "big1", "big2")  # rank 64: the high pool's
SMALL = ("small0", "small1", "small2")  # rank 8


@dataclass
class Pools:
    stack: Stack
    nats: Server
    gateway_url: str
    model_dir: Path
    adapters: Path
    metrics: dict[str, int]  # service key -> its /metrics port


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    from transformers import LlamaForCausalLM

    from tests.helpers.adapters import make_peft_model

    root = tmp_path_factory.mktemp("pools")
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
        "LF_MAX_RANK": "128",  # the registry's format limit lets rank 128 through: the fleet's classes refuse it
        "LF_LIVENESS_TIMEOUT_S": "3",
        "LF_ACCEPT_TIMEOUT_S": "30",
        "LF_NO_WORKER_GRACE_S": "5",
        "LF_ENGINE__MAX_NUM_SEQS": "1",  # one running request saturates a worker
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
        "LF_DEFAULT_QUOTA__REQUESTS_PER_MIN": "0",
        "LF_DEFAULT_QUOTA__TOKENS_PER_MIN": "0",
        "LF_DEFAULT_QUOTA__MAX_CONCURRENT": "0",
    }
    stack = Stack(env, root / "logs")
    metrics = {key: free_port() for key in ("scheduler", "high", "low")}
    try:
        stack.start("registry")
        stack.start("scheduler", {"LF_METRICS_PORT": str(metrics["scheduler"])})
        stack.start("gateway")
        high = {"LF_WORKER_ID": "high", "LF_WORKER_RANK_POOL": "high", "LF_METRICS_PORT": str(metrics["high"])}
        stack.start("worker", high, key="high")
        stack.start("worker", {"LF_WORKER_ID": "low", "LF_METRICS_PORT": str(metrics["low"])}, key="low")
        base = LlamaForCausalLM.from_pretrained(model_dir)
        ranks = {**dict.fromkeys(BIG, 64), **dict.fromkeys(SMALL, 8), "huge": 128}
        for seed, (name, rank) in enumerate(ranks.items()):
            make_peft_model(base, rank=rank, target_modules=("q_proj", "v_proj"), seed=seed).save_pretrained(
                root / "adapters" / name
            )
        asyncio.run(wait_ready(nats_server.url, stack, ("registry", "scheduler", "gateway"), 120))
        asyncio.run(wait_workers(nats_server.url, {"high", "low"}, 180))

        async def publish() -> None:
            nc = await nats.connect(nats_server.url)
            for name in (*BIG, *SMALL):
                record = await _push(nc, root / "adapters" / name, model_dir)
                promote = PromoteRequest(adapter_id=name, version=record.version, traffic_percent=100, actor="test")
                await request(nc, subjects.registry("promote"), promote, AdapterRecordsReply, 10)
            await nc.close()

        asyncio.run(publish())
        yield Pools(stack, nats_server, f"http://127.0.0.1:{port}", model_dir, root / "adapters", metrics)
    finally:
        stack.stop_all()
        redis.stop()
        nats_server.stop()


async def _push(nc, directory: Path, model_dir: Path):  # type: ignore[no-untyped-def]
    return await push_adapter(
        nc,
        directory,
        adapter_id=directory.name,
        tenant_id="demo",
        task_type="chat",
        base_fingerprint=fingerprint_model_dir(model_dir),
        who="test",
    )


async def _chat(client: httpx.AsyncClient, model: str, max_tokens: int = 2) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})


def _samples(port: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


async def test_rank_64_adapters_are_served_by_the_high_pool_and_rank_8_ones_elsewhere(pools: Pools) -> None:
    served: dict[str, set[str]] = {}
    async with httpx.AsyncClient(base_url=pools.gateway_url, timeout=60) as client:
        for _ in range(2):
            for name in (*BIG, *SMALL):  # one at a time: the whole fleet has room
                response = await _chat(client, name)
                assert response.status_code == 200, response.text
                served.setdefault(name, set()).add(response.headers["x-lorafleet-worker"])
    assert all(served[name] == {"high"} for name in BIG), served
    assert all(served[name] == {"low"} for name in SMALL), served


async def test_a_saturated_pool_spills_to_the_other_worker_and_counts_it(pools: Pools) -> None:
    async with httpx.AsyncClient(base_url=pools.gateway_url, timeout=120) as client:
        responses = await asyncio.gather(*(_chat(client, "big0", max_tokens=200) for _ in range(6)))
    workers = [r.headers["x-lorafleet-worker"] for r in responses if r.status_code == 200]
    assert len(workers) == 6, [r.text for r in responses]
    assert "high" in workers and "low" in workers, workers
    spills = _samples(pools.metrics["scheduler"], "scheduler_rank_spills_total")
    assert spills.get((("rank_class", "64"),), 0) >= workers.count("low"), spills
    log = (pools.stack.log_dir / "scheduler.log").read_text()
    assert '"rank_spill"' in log and '"rank_class": 64' in log


async def test_a_push_of_a_rank_no_worker_class_holds_is_refused_with_the_reason(pools: Pools) -> None:
    nc = await nats.connect(pools.nats.url)
    try:
        with pytest.raises(RankNotServed) as refused:
            await _push(nc, pools.adapters / "huge", pools.model_dir)
        get = GetAdapterRequest(adapter_id="huge")
        versions = await request(nc, subjects.registry("get"), get, AdapterRecordsReply, 10)
    finally:
        await nc.close()
    assert refused.value.status == 400
    assert "rank 128 fits no rank class of the fleet: classes 8, 16, 32, 64 (2 live workers)" in str(refused.value)
    assert versions.records == []


async def test_rank_metric_families_are_on_the_workers_scrapes(pools: Pools) -> None:
    """After the traffic of the tests above (module order)."""
    high_ttft = _samples(pools.metrics["high"], "rank_class_ttft_ms_count")
    high_tpot = _samples(pools.metrics["high"], "rank_class_tpot_ms_count")
    low_ttft = _samples(pools.metrics["low"], "rank_class_ttft_ms_count")
    assert high_ttft.get((("rank_class", "64"),), 0) >= len(BIG) * 2, high_ttft
    assert high_tpot.get((("rank_class", "64"),), 0) >= 1, high_tpot
    assert low_ttft.get((("rank_class", "8"),), 0) >= len(SMALL) * 2, low_ttft
    assert (("rank_class", "8"),) not in high_ttft  # rank-8 traffic kept off the pool
    # the low worker ran rank-8 decode steps and the spilled rank-64 ones, one token each
    skew = _samples(pools.metrics["low"], "engine_rank_skew_ratio")
    assert skew.get((("batch_tokens", "1"), ("rank_class", "64")), 0) > 0, skew
