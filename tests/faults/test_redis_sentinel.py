"""The platform on a replicated Redis: a master, one replica and three sentinels (the same
redis-server binary in sentinel mode), the scheduler and workers following the master through the
sentinels. Killing the master under steady load: every request is served whole or refused with a
typed error within its bound, none runs twice, the sentinels promote the replica within their
configured bound, and the services write to the new master after (the cost is in docs/operations.md)."""

import asyncio
import json
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import (
    SentinelTiming,
    Server,
    free_port,
    sentinel_addresses,
    start_nats,
    start_redis,
    start_sentinels,
    wait_sentinels,
)
from lorafleet.cli.stack import Stack, wait_ready
from shared.adapter_keys import HeatKeys, adapter_key
from tests.faults.conftest import ADAPTER, KEYS, REQUEST_TIMEOUT_S, SERVICES, WORKERS, make_adapter, release
from tests.faults.observe import audited, completions, readyz
from tests.faults.traffic import MIX, Outcome, chat, check_served_or_refused, gateway, steady
from tests.scheduler.conftest import MODEL, wait_workers

pytestmark = pytest.mark.timeout(600)
MASTER = "lorafleet"
PASSWORD = "fault-redis-pw"
PREFIX = "lf:"
MAX_TOKENS = 24
TIMING = SentinelTiming(down_after_ms=1000, failover_timeout_ms=3000, quorum=2)
# Sentinel's own bound: a master silent for down-after is failed over; a first election that fails is
# retried after two failover timeouts. Nothing here depends on how fast this machine decodes.
PROMOTION_BOUND_S = (TIMING.down_after_ms + 2 * TIMING.failover_timeout_ms) / 1000 + 5
GUARD_RETRY_S = 2.0  # services/scheduler/redis_guard.py: how long the scheduler skips Redis after a failure


@dataclass
class SentinelFleet:
    stack: Stack
    nats: Server
    master: Server
    replica: Server
    sentinels: list[Server]
    gateway_url: str
    db_path: Path
    report: Path

    def ready(self, timeout_s: float = 90) -> None:
        asyncio.run(wait_ready(self.nats.url, self.stack, SERVICES, timeout_s))
        asyncio.run(wait_workers(self.nats.url, set(WORKERS), timeout_s))


def _redis(server: Server) -> redis.Redis:
    return redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2, decode_responses=True)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelFleet]:
    root = tmp_path_factory.mktemp("sentinel")
    model_dir = make_tiny_model(root / MODEL)
    nats_server = start_nats(free_port(), root / "nats", root / "nats.log")
    master = start_redis(free_port(), root / "redis-a", root / "redis-a.log", password=PASSWORD)
    replica = start_redis(free_port(), root / "redis-b", root / "redis-b.log", PASSWORD, replicaof=master)
    sentinels = start_sentinels(
        [free_port() for _ in range(3)], master, root / "sentinels", root, MASTER, TIMING, PASSWORD
    )
    (root / "redis.pw").write_text(PASSWORD + "\n")
    port = free_port()
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": "redis://127.0.0.1:6379/0",  # only its db counts: the sentinels name the master
        "LF_REDIS_SENTINELS": sentinel_addresses(sentinels),
        "LF_REDIS_SENTINEL_MASTER": MASTER,
        "LF_REDIS_PASSWORD_FILE": str(root / "redis.pw"),
        "LF_REDIS_KEY_PREFIX": PREFIX,
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
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
    }
    stack = Stack(env, root / "logs")
    running = SentinelFleet(
        stack, nats_server, master, replica, sentinels, f"http://127.0.0.1:{port}", root / "audit.sqlite3",
        root / "failover.json",
    )  # fmt: skip
    try:
        wait_sentinels(sentinels, MASTER, 1, 60, PASSWORD)
        for name in SERVICES:
            stack.start(name)
        for worker in WORKERS:
            stack.start("worker", {"LF_WORKER_ID": worker}, key=worker)
        running.ready(180)
        asyncio.run(release(nats_server.url, model_dir, make_adapter(model_dir, root / ADAPTER, 5), ADAPTER))
        yield running
    finally:
        stack.stop_all()
        for server in (*sentinels, replica, master):
            server.stop()
        nats_server.stop()


class Promotion(threading.Thread):
    """From the kill on, polls the sentinels for the master's address and the promoted server for the
    scheduler's first dedupe marker written there: the failover window, as the fleet lives it."""

    def __init__(self, fleet: SentinelFleet):
        super().__init__(daemon=True)
        self.fleet = fleet
        self.killed_at = 0.0
        self.promoted_at: float | None = None  # the sentinels name another master
        self.followed_at: float | None = None  # the scheduler wrote a new marker to it
        self.new_master: tuple[str, int] | None = None

    def run(self) -> None:
        deadline = self.killed_at + PROMOTION_BOUND_S + GUARD_RETRY_S + 30
        with _redis(self.fleet.sentinels[0]) as sentinel:
            while self.promoted_at is None and time.monotonic() < deadline:
                address = sentinel.sentinel_get_master_addr_by_name(MASTER)
                if address and int(address[1]) != self.fleet.master.port:
                    self.promoted_at, self.new_master = time.monotonic(), (address[0], int(address[1]))
                time.sleep(0.02)
        if self.new_master is None:
            return
        with redis.Redis(port=self.new_master[1], password=PASSWORD, decode_responses=True) as promoted:
            before = set(promoted.scan_iter(f"{PREFIX}dispatched:*"))
            while self.followed_at is None and time.monotonic() < deadline:
                if set(promoted.scan_iter(f"{PREFIX}dispatched:*")) - before:
                    self.followed_at = time.monotonic()
                time.sleep(0.02)


def _kill_master_under_load(fleet: SentinelFleet) -> tuple[list[Outcome], Promotion]:
    promotion = Promotion(fleet)

    async def run() -> list[Outcome]:
        async with gateway(fleet.gateway_url) as client:
            load = asyncio.create_task(steady(client, 60, 0.2, MAX_TOKENS))
            await asyncio.sleep(4.0)  # requests before the fault, for the TTFT they see then
            fleet.master.proc.send_signal(signal.SIGKILL)
            fleet.master.proc.wait()
            promotion.killed_at = time.monotonic()
            promotion.start()
            return await load

    outcomes = asyncio.run(run())
    promotion.join(PROMOTION_BOUND_S + GUARD_RETRY_S + 40)
    return outcomes, promotion


def _ttft_ms(outcomes: list[Outcome]) -> dict[str, float | int]:
    ttfts = sorted(o.ttft_s * 1000 for o in outcomes if o.served and o.ttft_s is not None)
    if not ttfts:
        return {"n": 0}
    return {"n": len(ttfts), "p50": round(statistics.median(ttfts)), "max": round(ttfts[-1])}


def _record(fleet: SentinelFleet, outcomes: list[Outcome], promotion: Promotion) -> dict:
    assert promotion.promoted_at is not None and promotion.followed_at is not None
    window_end = max(promotion.promoted_at, promotion.followed_at)
    before = [o for o in outcomes if o.started_s < promotion.killed_at]
    during = [o for o in outcomes if promotion.killed_at <= o.started_s <= window_end]
    refused: dict[str, int] = {}
    for o in outcomes:
        if not o.served:
            refused[f"{o.status} {o.code}"] = refused.get(f"{o.status} {o.code}", 0) + 1
    report = {
        "sentinel_down_after_ms": TIMING.down_after_ms,
        "promoted_after_kill_s": round(promotion.promoted_at - promotion.killed_at, 2),
        "scheduler_on_new_master_after_kill_s": round(promotion.followed_at - promotion.killed_at, 2),
        "requests": len(outcomes),
        "served": sum(o.served for o in outcomes),
        "refused": refused,
        "ttft_ms_before": _ttft_ms(before),
        "ttft_ms_during_window": _ttft_ms(during),
    }
    fleet.report.write_text(json.dumps(report, indent=2))
    print("redis failover:", json.dumps(report))
    return report


def test_killing_the_redis_master_under_load_loses_and_repeats_nothing(fleet: SentinelFleet) -> None:
    outcomes, promotion = _kill_master_under_load(fleet)

    check_served_or_refused(outcomes)
    assert all(o.whole(MAX_TOKENS) for o in outcomes if o.served), [o.describe() for o in outcomes]
    assert sum(o.served for o in outcomes) >= len(outcomes) // 2, [o.describe() for o in outcomes]
    counts = asyncio.run(audited(fleet.db_path, {o.request_id for o in outcomes if o.served}, 30))
    assert max(counts.values()) == 1, {rid: n for rid, n in counts.items() if n > 1}
    assert max(completions(fleet.db_path).values()) == 1

    report = _record(fleet, outcomes, promotion)
    assert promotion.new_master == ("127.0.0.1", fleet.replica.port)
    assert report["promoted_after_kill_s"] < PROMOTION_BOUND_S, report
    assert report["scheduler_on_new_master_after_kill_s"] < PROMOTION_BOUND_S + GUARD_RETRY_S + 1, report

    # after: full capacity, and the services' state written to the promoted replica
    fleet.ready(60)

    with _redis(fleet.replica) as promoted:
        decayed_at = float(promoted.get(HeatKeys.under(PREFIX).decayed_at) or 0)

    async def served_after() -> list[Outcome]:
        await readyz(fleet.gateway_url, 200, 60)
        async with gateway(fleet.gateway_url) as client:
            calls = (chat(client, key, model, max_tokens=8) for key, model in MIX for _ in range(3))
            return list(await asyncio.gather(*calls))

    after = asyncio.run(served_after())
    assert all(o.whole(8) for o in after), [o.describe() for o in after]
    with _redis(fleet.replica) as promoted:
        assert promoted.info("replication")["role"] == "master"
        for o in after:  # the scheduler's dedupe marker of each, on the new master
            assert len(list(promoted.scan_iter(f"{PREFIX}dispatched:*:{o.request_id}"))) == 1, o.describe()
        assert (promoted.zscore(HeatKeys.under(PREFIX).counts, adapter_key(ADAPTER, 1)) or 0) > 0
        deadline = time.monotonic() + 30  # its heat decay ticks there too
        while float(promoted.get(HeatKeys.under(PREFIX).decayed_at) or 0) <= decayed_at:
            assert time.monotonic() < deadline, "the scheduler never decayed heat on the new master"
            time.sleep(0.2)
