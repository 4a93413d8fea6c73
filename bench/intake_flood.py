"""The flood half of ``bench.fairness``, live: one tenant's flood of N submissions stored in a real
INFER stream ahead of a quiet tenant's one, then the scheduler's real consume loop (its ports on
the real bus, admission on a real Redis, the platform's default quotas). Measured: the quiet
tenant's queueing delay at intake, from the loop's start to its request being admitted.

Peers in the same run: the scheduler's intake (one admission per tenant per turn) and the same
loop with every submission in one arrival-order queue, as intake was before. No worker runs, so
the flood holds its tenant's concurrency (the default 32) and the rest of it is refused; a flood
past the stream's per-tenant bound (``LF_STREAMS__INFER_MAX_MSGS_PER_TENANT``, 1,000) is refused
at publish, so 3,000 offered leave 1,000 ahead."""

import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg
from nats.js.errors import APIError, NotFoundError

from lorafleet.cli.infra import free_port, start_nats, start_redis
from services.scheduler.held import Handle
from services.scheduler.ports import bus_ports
from services.scheduler.service import Scheduler, build
from services.scheduler.settings import SchedulerSettings
from services.scheduler.waiting import Intake
from shared import subjects
from shared.bus import encode, ensure_streams
from shared.catalog.view import follow_catalog
from shared.config import StreamLimits
from shared.redis_conn import connect_redis
from shared.schemas import InferRequest

QUIET = "quiet-0"


class ArrivalOrder(Scheduler):
    """The peer: the same loop, every tenant's submissions in one queue in the stream's order."""

    async def on_fetched(self, msg: Msg) -> None:
        self.intake.push("", msg, time.monotonic())
        self._arrived.set()


async def _publish(js, rid: str, tenant: str) -> None:
    request = InferRequest(
        request_id=rid,
        tenant_id=tenant,
        model="base",
        base_model="base",
        prompt="hello",
        reply_to="_INBOX.bench",
        sampling={"max_tokens": 16},
    )
    # as the gateway submits: a direct-NATS tenant's replies must go to its own _INBOX_<t> inbox
    await js.publish(subjects.infer_submit(tenant, subjects.VIA_GATEWAY), encode(request), headers={"Nats-Msg-Id": rid})


async def _one(nats_url: str, redis_url: str, fair: bool, flood: int) -> float:
    """The quiet tenant's delay (ms) behind a stored flood of ``flood``."""
    nc = await nats.connect(nats_url)
    redis = connect_redis(redis_url)
    stop = asyncio.Event()
    try:
        js = nc.jetstream()
        with contextlib.suppress(NotFoundError):
            await js.delete_stream(subjects.INFER_STREAM)
        await ensure_streams(js, StreamLimits())
        settings = SchedulerSettings(redis_key_prefix=f"b{time.monotonic_ns()}:", no_worker_grace_s=300)
        followed = await follow_catalog(nc, settings.dispatch_timeout_s, route="nats")
        core, upkeep = build(settings, bus_ports(nc, js, settings, followed.view), redis)
        if fair:
            scheduler = Scheduler(nc, core, upkeep, settings.max_inflight, Intake(settings.intake_per_tenant))
        else:
            scheduler = ArrivalOrder(nc, core, upkeep, settings.max_inflight, Intake(10**6))
        admitted = asyncio.Event()
        submit = core.submit

        async def watched(
            subject: str, data: bytes, handle: Handle, seq: int | None = None, stored_at: float | None = None
        ) -> None:
            await submit(subject, data, handle, seq, stored_at)
            if QUIET in core.held:
                admitted.set()

        core.submit = watched  # type: ignore[method-assign]
        psub = await scheduler.subscribe(js)
        for i in range(flood):
            with contextlib.suppress(APIError):  # past the stream's per-tenant bound: refused at publish
                await _publish(js, f"flood-{i}", "flood")
        await _publish(js, QUIET, "quiet")
        start = time.perf_counter()
        consuming = asyncio.create_task(scheduler.consume(psub, stop))
        await asyncio.wait_for(admitted.wait(), 120)
        delay_ms = (time.perf_counter() - start) * 1000
        stop.set()
        await consuming
        await psub.unsubscribe()
        followed.stop()
        return delay_ms
    finally:
        await redis.aclose()
        await nc.close()


async def _all(nats_url: str, redis_url: str, sizes: list[int], repeats: int) -> dict:
    rows = []
    for flood in sizes:
        row: dict = {"flood": flood}
        for name, fair in (("fair_intake", True), ("arrival_order", False)):
            runs = [await _one(nats_url, redis_url, fair, flood) for _ in range(repeats)]
            row[f"{name}_ms"] = statistics.median(runs)
        rows.append(row)
    return {"repeats": repeats, "rows": rows}


def run_flood(sizes: list[int], repeats: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lf-flood-"))
    nats_server = start_nats(free_port(), root / "nats")
    try:
        redis_server = start_redis(free_port(), root / "redis")
        try:
            return asyncio.run(_all(nats_server.url, redis_server.url, sizes, repeats))
        finally:
            redis_server.stop()
    finally:
        nats_server.stop()


def flood_markdown(result: dict) -> str:
    lines = [
        "| flood (requests ahead) | quiet tenant delay, fair intake (ms) | arrival order (ms) | arrival / fair |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        ratio = row["arrival_order_ms"] / row["fair_intake_ms"]
        lines.append(f"| {row['flood']} | {row['fair_intake_ms']:.1f} | {row['arrival_order_ms']:.1f} | {ratio:.1f}x |")
    lines.append(f"\nmedian of {result['repeats']} runs each; live nats-server and redis-server, no worker")
    return "\n".join(lines)
