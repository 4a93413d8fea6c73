"""A client that goes away mid-stream: its worker stops generating, frees the sequence's KV blocks
and releases its adapter, so that the slot may be evicted again."""

import asyncio
import time

import httpx
import pytest

from shared.schemas import WorkerControl
from tests.faults.conftest import ADAPTER, MAX_MODEL_LEN, Fleet
from tests.faults.observe import WorkerBeats, audited, completion_bodies, idle
from tests.faults.traffic import PROMPT, gateway
from tests.scheduler.conftest import MODEL

pytestmark = pytest.mark.timeout(120)
# tokens asked for: seconds of decoding on the fastest machine, far more than a test's steps take (each waits
# on an event: a worker's answer or its next heartbeat), so only a cancel can end the stream early
LONG = MAX_MODEL_LEN - 256
KEY = f"{ADAPTER}@1"


class Stream:
    """A streamed chat completion the client reads a little of, then abandons."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.headers = response.headers
        self._lines = response.aiter_lines()  # one iterator: dropping one would close the connection

    async def read_tokens(self, n: int) -> None:
        """Read until ``n`` token chunks came (the first chunk only carries the role)."""
        seen = 0
        while seen < n:
            line = await anext(self._lines, None)
            assert line is not None and line != "data: [DONE]", "the stream ended before the client left"
            if line.startswith("data: ") and '"content"' in line and '"role"' not in line:
                seen += 1

    async def leave(self) -> None:
        await self.response.aclose()


async def open_stream(client: httpx.AsyncClient, key: str, model: str) -> Stream:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    response = await client.send(
        client.build_request("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body),
        stream=True,
    )
    assert response.status_code == 200, await response.aread()
    return Stream(response)


async def left_early(fleet: Fleet, request_ids: list[str]) -> None:
    """Each request ran once and was cancelled on its worker, far short of what it asked for."""
    counts = await audited(fleet.db_path, set(request_ids), 15)
    for rid in request_ids:
        assert counts[rid] == 1, rid
        record = completion_bodies(fleet.db_path, rid)[0]
        assert record["outcome"] == "cancelled" and record["completion_tokens"] < LONG, record


async def evictable(beats: WorkerBeats, worker: str) -> None:
    """The adapter's slot holds no request any more: an evict directive takes it out."""
    evict = WorkerControl(action="evict", adapter_id=ADAPTER, adapter_version=1)
    sent = time.time()
    # not_resident: the scheduler evicted a cold replica first, which it can do only to a slot nothing holds
    assert (await beats.ask(worker, evict)).outcome in ("done", "not_resident")
    await beats.until(worker, lambda b: KEY not in b.resident_adapters, 5, after=sent)


async def test_a_client_leaving_a_base_model_stream_frees_its_kv_blocks(fleet):
    async with WorkerBeats(fleet.nats.url) as beats, gateway(fleet.gateway_url) as client:
        stream = await open_stream(client, "key-demo", MODEL)
        worker, rid = stream.headers["x-lorafleet-worker"], stream.headers["x-lorafleet-request-id"]
        await stream.read_tokens(3)
        await beats.until(worker, lambda b: b.running == 1 and b.kv_blocks_free < b.kv_blocks_total, 5)
        left = time.time()
        await stream.leave()
        await beats.until(worker, idle, 5, after=left)
    await left_early(fleet, [rid])


async def test_a_client_leaving_an_adapter_stream_frees_kv_and_the_adapter_slot(fleet):
    async with WorkerBeats(fleet.nats.url) as beats, gateway(fleet.gateway_url) as client:
        stream = await open_stream(client, "key-demo", ADAPTER)
        worker, rid = stream.headers["x-lorafleet-worker"], stream.headers["x-lorafleet-request-id"]
        await stream.read_tokens(3)
        refused = await beats.ask(worker, WorkerControl(action="evict", adapter_id=ADAPTER, adapter_version=1))
        assert refused.outcome == "in_flight"  # the slot is not taken from under a running request
        prefetch = WorkerControl(action="prefetch", adapter_id=ADAPTER, adapter_version=1)
        assert (await beats.ask(worker, prefetch)).outcome == "resident_or_loading"
        await stream.read_tokens(2)  # and the stream goes on
        left = time.time()
        await stream.leave()
        await beats.until(worker, idle, 5, after=left)
        cancel = WorkerControl(action="cancel", tenant_id="demo", request_id=rid)
        assert (await beats.ask(worker, cancel)).outcome == "not_running"  # the leaving client's cancel ended it
        await evictable(beats, worker)
    await left_early(fleet, [rid])


async def test_many_clients_leaving_at_once_free_everything(fleet):
    async with WorkerBeats(fleet.nats.url) as beats, gateway(fleet.gateway_url) as client:
        streams = await asyncio.gather(
            *(
                open_stream(client, key, model)
                for key, model in [
                    ("key-demo", MODEL),
                    ("key-other", MODEL),
                    ("key-demo", ADAPTER),
                    ("key-demo", ADAPTER),
                    ("key-other", MODEL),
                    ("key-demo", ADAPTER),
                ]
            )
        )
        await asyncio.gather(*(s.read_tokens(2) for s in streams))
        workers = {s.headers["x-lorafleet-worker"] for s in streams}
        with_adapter = {s.headers["x-lorafleet-worker"] for s in streams if s.headers["x-lorafleet-adapter"]}
        left = time.time()
        await asyncio.gather(*(s.leave() for s in streams))
        for worker in workers:
            await beats.until(worker, idle, 8, after=left)
        for worker in with_adapter:
            await evictable(beats, worker)
    await left_early(fleet, [s.headers["x-lorafleet-request-id"] for s in streams])
