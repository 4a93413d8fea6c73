"""Pins on a real fleet: nats-server, redis-server, the registry and two worker processes on a tiny
random Llama, three rank-8 slots each. A pinned adapter survives an eviction storm on every worker,
is pinned again by a restarted worker, and is evictable again once unpinned."""

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import nats
import pytest

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import decode, encode, request
from shared.catalog.resolve import to_resolved
from shared.schemas import (
    AdapterRecordsReply,
    GetAdapterRequest,
    InferRequest,
    PinRequest,
    PinsReply,
    ReplyEnvelope,
    ReplyError,
    ReplyFinal,
    SamplingParams,
    WorkerHeartbeat,
)
from tests.faults.conftest import make_adapter, release
from tests.scheduler.conftest import MODEL, wait_workers

WORKERS = ("w1", "w2")
PINNED = "keep"
STORM = [f"storm{i}" for i in range(5)]
WAIT_S = 60


@dataclass
class PinFleet:
    stack: Stack
    nats: Server
    worker_env: dict[str, str]

    def start_worker(self, worker: str) -> None:
        self.stack.start("worker", {**self.worker_env, "LF_WORKER_ID": worker}, key=worker)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PinFleet]:
    root = tmp_path_factory.mktemp("pins")
    model_dir = make_tiny_model(root / MODEL)
    adapter_dir = make_adapter(model_dir, root / "adapter", seed=5)
    nats_server = start_nats(free_port(), root / "nats")
    redis = start_redis(free_port(), root / "redis")
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": redis.url,
        "LF_MODEL_DIR": str(model_dir),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_LIVENESS_TIMEOUT_S": "3",
        "LF_METRICS_PORT": "-1",
    }
    worker_env = {
        "LF_LORA__RANK_CLASSES": "[8]",
        "LF_LORA__MAX_SLOTS_PER_CLASS": "3",
        "LF_CACHE__POLICY": "lru",
        "LF_PIN_REFRESH_S": "0.5",
        "LF_ENGINE__MAX_NUM_SEQS": "2",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
    }
    stack = Stack(env, root / "logs")
    running = PinFleet(stack, nats_server, worker_env)
    try:
        stack.start("registry")
        for worker in WORKERS:
            running.start_worker(worker)
        asyncio.run(wait_ready(nats_server.url, stack, ("registry",), 120))
        asyncio.run(wait_workers(nats_server.url, set(WORKERS), 180))
        for adapter_id in (PINNED, *STORM):
            asyncio.run(release(nats_server.url, model_dir, adapter_dir, adapter_id))
        yield running
    finally:
        stack.stop_all()
        redis.stop()
        nats_server.stop()


class Beats:
    """The newest heartbeat of each worker."""

    def __init__(self) -> None:
        self.latest: dict[str, WorkerHeartbeat] = {}

    async def on_beat(self, msg) -> None:
        beat = decode(WorkerHeartbeat, msg.data)
        self.latest[beat.worker_id] = beat

    async def until(self, worker: str, check, what: str) -> WorkerHeartbeat:
        """Wait for a heartbeat of ``worker`` sent after now that passes ``check``."""
        since, deadline = time.time(), time.monotonic() + WAIT_S
        while True:
            beat = self.latest.get(worker)
            if beat is not None and beat.ts > since and check(beat):
                return beat
            assert time.monotonic() < deadline, f"{worker}: {what}; last heartbeat {beat}"
            await asyncio.sleep(0.05)


async def _serve(nc, worker: str, adapter_id: str) -> None:
    """One request for ``adapter_id`` dispatched to ``worker`` as the scheduler does; waits for its end."""
    (record,) = (await request(nc, subjects.registry("get"), GetAdapterRequest(adapter_id=adapter_id),
                               AdapterRecordsReply, 10)).records  # fmt: skip
    rid = f"pin-{uuid.uuid4().hex[:12]}"
    inbox = f"_INBOX.{rid}"
    sub = await nc.subscribe(inbox)
    req = InferRequest(request_id=rid, tenant_id="demo", model=adapter_id, base_model=MODEL,
                       adapter=to_resolved(record), prompt="hello", reply_to=inbox,
                       sampling=SamplingParams(max_tokens=2, temperature=0))  # fmt: skip
    try:
        await nc.request(subjects.worker_dispatch(worker), encode(req), timeout=10)
        deadline = time.monotonic() + WAIT_S
        while True:
            body = decode(ReplyEnvelope, (await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data).body
            assert not isinstance(body, ReplyError), body
            if isinstance(body, ReplyFinal):
                return
    finally:
        await sub.unsubscribe()


async def _pin(nc, op: str) -> PinsReply:
    return await request(nc, subjects.registry(op), PinRequest(adapter_id=PINNED, actor="test"), PinsReply, 10)


def _holds(key: str):
    return lambda beat: key in beat.pinned and key in beat.resident_adapters


async def _storm(nc, worker: str, beats: Beats, adapters: list[str]) -> WorkerHeartbeat:
    """Every adapter of ``adapters`` through ``worker`` in turn: more than its two unpinned slots hold."""
    for adapter_id in adapters:
        await _serve(nc, worker, adapter_id)
    return await beats.until(worker, lambda b: f"{adapters[-1]}@1" in b.resident_adapters, "the storm never landed")


async def test_a_pin_survives_an_eviction_storm_on_every_worker_and_a_restart_until_unpinned(fleet: PinFleet):
    key = f"{PINNED}@1"
    nc = await nats.connect(fleet.nats.url)
    beats = Beats()
    await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=beats.on_beat)
    try:
        assert [p.worker_id for p in (await _pin(nc, "pin")).pins] == [None]
        for worker in WORKERS:  # not resident before: the pin loads it on each worker
            beat = await beats.until(worker, _holds(key), "the pinned adapter never became resident")
            assert beat.slots == {"8": [1, 3]}  # two slots left to the storm
        for worker in WORKERS:
            after = await _storm(nc, worker, beats, STORM)
            assert key in after.resident_adapters and f"{STORM[0]}@1" not in after.resident_adapters  # storm evicted
        fleet.stack.stop("w2")
        fleet.start_worker("w2")
        await wait_workers(fleet.nats.url, {"w2"}, 120)
        await beats.until("w2", _holds(key), "the restarted worker never pinned it again")
        after = await _storm(nc, "w2", beats, STORM[:3])
        assert key in after.resident_adapters
        assert (await _pin(nc, "unpin")).pins == []
        for worker in WORKERS:
            await beats.until(worker, lambda b: b.pinned == [], "the unpin never reached the worker")
            after = await _storm(nc, worker, beats, STORM[2:])  # the never-requested adapter is LRU's first victim
            assert key not in after.resident_adapters
    finally:
        await nc.close()
