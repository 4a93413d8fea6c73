"""What the fleet shows from outside: worker heartbeats (KV blocks, running sequences, resident
adapters), the auditor's index of completions, and the gateway's readiness."""

import asyncio
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

from shared import subjects
from shared.bus import decode, encode
from shared.schemas import WorkerControl, WorkerHeartbeat


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
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass

    async def control(self, worker: str, message: WorkerControl) -> None:
        assert self._nc is not None
        await self._nc.publish(subjects.worker_control(worker), encode(message))
        await self._nc.flush()


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
