"""What the fleet shows from outside: worker heartbeats (KV blocks, running sequences, resident
adapters), the scheduler's own accounting on its /metrics, the auditor's index of completions,
and the gateway's readiness."""

import asyncio
import contextlib
import json
import sqlite3
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Self

import httpx
import nats
from nats.aio.client import Client as NATS
from prometheus_client.parser import text_string_to_metric_families

from shared import subjects
from shared.bus import decode, encode
from shared.schemas import ServiceHeartbeat, WorkerControl, WorkerControlReply, WorkerHeartbeat
from tests.helpers.bus import settled


class WorkerBeats:
    """The latest heartbeat of every worker, followed on the bus while the context is open."""

    def __init__(self, nats_url: str):
        self._url = nats_url
        self._nc: NATS | None = None
        self.latest: dict[str, WorkerHeartbeat] = {}
        self._changed = asyncio.Event()

    async def __aenter__(self) -> Self:
        self._nc = await nats.connect(self._url)

        async def on_beat(msg) -> None:
            beat = decode(WorkerHeartbeat, msg.data)
            self.latest[beat.worker_id] = beat
            self._changed.set()

        await self._nc.subscribe(subjects.WORKER_HEARTBEAT, cb=on_beat)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._nc is not None
        await self._nc.close()

    async def until(
        self, worker: str, check: Callable[[WorkerHeartbeat], bool], timeout_s: float, after: float | None = None
    ) -> WorkerHeartbeat:
        """The first heartbeat of ``worker`` (sent after ``after``, a wall-clock time) that passes ``check``."""
        deadline = time.monotonic() + timeout_s
        while True:
            beat = self.latest.get(worker)
            if beat is not None and (after is None or beat.ts > after) and check(beat):
                return beat
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{worker}: no heartbeat passed the check in {timeout_s}s; last: {beat}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def control(self, worker: str, message: WorkerControl) -> None:
        assert self._nc is not None
        await self._nc.publish(subjects.worker_control(worker), encode(message))
        await settled(self._nc)

    async def ask(self, worker: str, message: WorkerControl) -> WorkerControlReply:
        """Send a control message and wait for the worker's answer: what it did."""
        assert self._nc is not None
        msg = await self._nc.request(subjects.worker_control(worker), encode(message), timeout=10)
        return decode(WorkerControlReply, msg.data)


class SchedulerMetrics:
    """The scheduler's /metrics, scraped on the port its service heartbeat announces."""

    def __init__(self, nats_url: str):
        self._url = nats_url
        self._http = httpx.AsyncClient(timeout=5)
        self.port: int | None = None

    async def __aenter__(self) -> Self:
        nc = await nats.connect(self._url)
        try:
            beats = await nc.subscribe(subjects.service_heartbeat("scheduler"))
            for _ in range(10):  # the scheduler beats every second
                self.port = decode(ServiceHeartbeat, (await beats.next_msg(timeout=10)).data).metrics_port
                if self.port is not None:
                    return self
        finally:
            await nc.close()
        raise AssertionError("the scheduler announces no metrics port (LF_METRICS_PORT=-1?)")

    async def __aexit__(self, *_: object) -> None:
        await self._http.aclose()

    async def per_worker(self, sample: str) -> dict[str, float]:
        """Worker id -> value of ``sample`` (e.g. ``scheduler_dispatches_total``) now."""
        text = (await self._http.get(f"http://127.0.0.1:{self.port}/metrics")).text
        return {
            s.labels["worker"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == sample
        }

    async def until_idle(self, workers: tuple[str, ...], timeout_s: float) -> None:
        """Until the scheduler counts nothing in flight on any of ``workers`` (each one in its fleet)."""
        deadline = time.monotonic() + timeout_s
        while True:
            inflight = await self.per_worker("scheduler_worker_inflight")
            if all(inflight.get(w) == 0 for w in workers):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the scheduler still counts requests in flight after {timeout_s}s: {inflight}")
            await asyncio.sleep(0.25)


def idle(beat: WorkerHeartbeat) -> bool:
    """Nothing running or waiting, and every KV block back on the free list."""
    return beat.running == 0 and beat.waiting == 0 and beat.kv_blocks_free == beat.kv_blocks_total


def completions(db_path: Path) -> Counter[str]:
    """Request id -> completion records the auditor indexed (each run of a request on a worker writes one)."""
    with sqlite3.connect(db_path, timeout=5) as db:
        rows = db.execute("SELECT request_id FROM audit WHERE kind = 'completion'").fetchall()
    return Counter(request_id for (request_id,) in rows)


def completion_bodies(db_path: Path, request_id: str) -> list[dict]:
    with sqlite3.connect(db_path, timeout=5) as db:
        rows = db.execute(
            "SELECT body FROM audit WHERE kind = 'completion' AND request_id = ?", (request_id,)
        ).fetchall()
    return [json.loads(body) for (body,) in rows]


async def audited(db_path: Path, request_ids: set[str], timeout_s: float) -> Counter[str]:
    """The auditor's completion counts, once every one of ``request_ids`` is indexed."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = completions(db_path)
        missing = request_ids - set(counts)
        if not missing:
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"the auditor never indexed {len(missing)} completions, e.g. {sorted(missing)[:3]}")
        await asyncio.sleep(0.3)


async def readyz(gateway_url: str, want: int, timeout_s: float) -> dict:
    """Poll /readyz until it answers ``want``; its components."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=gateway_url, timeout=5) as client:
        while True:
            try:
                response = await client.get("/readyz")
                if response.status_code == want:
                    return response.json()["components"]
                last = response.text
            except httpx.HTTPError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise AssertionError(f"/readyz never answered {want} in {timeout_s}s; last: {last}")
            await asyncio.sleep(0.3)
