"""Rank admission at push, from the fleet's declared classes, on a real registry over a real
nats-server: with no worker live the configured LF_FLEET_RANK_CLASSES decide, with live workers
their heartbeats do; each admitted version records one slot's bytes per rank class that holds it."""

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS

from services.registry.fleet_ranks import FleetRanks
from services.registry.service import run
from services.registry.settings import RegistrySettings
from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import connect, encode, request
from shared.errors import RankNotServed
from shared.schemas import (
    AdapterRecordsReply,
    EngineCapability,
    GetAdapterRequest,
    RegisterRequest,
    ServiceHeartbeat,
    WorkerHeartbeat,
)
from tests.registry.conftest import TINY

# one rank unit of a q_proj + v_proj adapter on TINY: 2 layers x ((64 + 64) + (64 + 32)) elements x 4 bytes
QV_BYTES_PER_RANK = 2 * ((64 + 64) + (64 + 32)) * 4


def _adapter(directory: Path, rank: int) -> dict[str, str]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(rank)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("model_type", "architectures")}))
    config = LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(directory)
    return {name: base64.b64encode((directory / name).read_bytes()).decode() for name in (CONFIG_FILE, WEIGHTS_FILE)}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, str]]:
    return {rank: _adapter(tmp_path_factory.mktemp(f"r{rank}"), rank) for rank in (8, 16)}


@pytest.fixture
async def registry(nats_url: str, base_dir: Path) -> AsyncIterator[NATS]:
    settings = RegistrySettings(
        nats_url=nats_url,
        model_dir=str(base_dir),
        instance_id="reg-ranks",
        heartbeat_interval_s=0.1,
        liveness_timeout_s=1.0,
        max_rank=16,
        dev_mode=True,
        fleet_rank_classes=(8,),
    )
    nc = await connect(nats_url, "rank-admission-test")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    beat = ServiceHeartbeat.model_validate_json((await beats.next_msg(timeout=30)).data)
    assert (beat.service, beat.ready) == ("registry", True)
    await beats.unsubscribe()
    yield nc
    stop.set()
    await service
    await nc.drain()


def _beat(worker_id: str, slots: dict[str, list[int]], model: str = "tiny-llama", max_rank: int | None = None):
    return WorkerHeartbeat(
        worker_id=worker_id,
        base_model=model,
        ready=True,
        running=0,
        waiting=0,
        max_running=4,
        kv_blocks_free=10,
        kv_blocks_total=10,
        slots=slots,
        capability=EngineCapability(max_lora_rank=max_rank),
    )


@contextlib.asynccontextmanager
async def live_workers(nc: NATS, *beats: WorkerHeartbeat) -> AsyncIterator[None]:
    """Workers' heartbeats on the bus, every 0.1 s, for the block's duration."""

    async def beat() -> None:
        while True:
            for b in beats:
                await nc.publish(subjects.WORKER_HEARTBEAT, encode(b))
            await asyncio.sleep(0.1)

    task = asyncio.create_task(beat())
    try:
        await asyncio.sleep(0.3)
        yield
    finally:
        task.cancel()


async def _push(nc: NATS, adapter_id: str, files: dict[str, str]) -> AdapterRecordsReply:
    req = RegisterRequest(adapter_id=adapter_id, tenant_id="acme", task_type="t", inline_files=files, actor="t")
    return await request(nc, subjects.registry("register"), req, AdapterRecordsReply, 10.0)


async def _versions(nc: NATS, adapter_id: str) -> list:
    req = GetAdapterRequest(adapter_id=adapter_id)
    return (await request(nc, subjects.registry("get"), req, AdapterRecordsReply, 10.0)).records


async def test_a_rank_no_class_holds_is_refused_with_the_reason_and_stores_nothing(registry: NATS, adapters):
    with pytest.raises(RankNotServed) as refused:
        await _push(registry, "wide16", adapters[16])
    error = refused.value
    assert (error.status, error.code, error.param) == (400, "rank_not_served", "r")
    assert "rank 16 fits no rank class of the fleet: classes 8 (LF_FLEET_RANK_CLASSES, no worker live)" in str(error)
    assert await _versions(registry, "wide16") == []


async def test_live_workers_classes_decide_and_slot_bytes_are_recorded_per_class(registry: NATS, adapters):
    small = (await _push(registry, "qv8", adapters[8])).records[0]
    assert small.slot_bytes == {"8": 8 * QV_BYTES_PER_RANK}
    fleet = (
        _beat("w-a", {"8": [0, 4], "16": [1, 4]}),
        _beat("w-b", {"8": [0, 4], "16": [0, 4], "32": [0, 2]}, max_rank=16),  # its engine stops at 16
        _beat("w-other", {"64": [0, 4]}, model="another-base"),  # serves another base model: not this fleet
    )
    async with live_workers(registry, *fleet):
        wide = (await _push(registry, "wide16", adapters[16])).records[0]
        again = (await _push(registry, "qv8", adapters[8])).records[0]
    assert wide.slot_bytes == {"16": 16 * QV_BYTES_PER_RANK}
    assert again.slot_bytes == {"8": 8 * QV_BYTES_PER_RANK, "16": 16 * QV_BYTES_PER_RANK}
    [stored] = await _versions(registry, "wide16")
    assert stored.slot_bytes == wide.slot_bytes  # the adapter record shows it
    deadline = time.monotonic() + 10
    while True:  # the workers fall silent: past the liveness timeout the configured classes decide again
        try:
            await _push(registry, f"late{int(time.monotonic() * 1000)}", adapters[16])
        except RankNotServed as e:
            assert "LF_FLEET_RANK_CLASSES" in str(e)
            break
        assert time.monotonic() < deadline, "the silent workers' classes still admit rank 16"
        await asyncio.sleep(0.5)


def test_fleet_ranks_follow_readiness_base_model_and_engine_limits():
    fleet = FleetRanks("tiny-llama", (8, 16), timeout_s=5)
    assert fleet.current(now=0).classes == (8, 16)
    fleet.heartbeat(_beat("a", {"8": [0, 1], "64": [0, 1]}), now=0)
    fleet.heartbeat(_beat("b", {"32": [0, 1], "64": [0, 1]}, max_rank=32), now=0)
    fleet.heartbeat(_beat("c", {"128": [0, 1]}, model="other"), now=0)
    assert fleet.current(now=1).classes == (8, 32, 64) and fleet.current(now=1).source == "2 live workers"
    fleet.heartbeat(_beat("a", {"8": [0, 1]}).model_copy(update={"ready": False}), now=2)  # draining
    assert fleet.current(now=3).classes == (32,)
    assert fleet.current(now=6).classes == (8, 16)  # b silent past the timeout
