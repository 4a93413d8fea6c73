"""Dedupe across a Redis outage (a restart, or a Sentinel failover to a replica that never got the
last writes): what one scheduler dispatched meanwhile reaches Redis once it answers again, so another
scheduler never runs a redelivery of it a second time."""

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.cli.infra import Server, free_port, start_redis
from services.scheduler.dedupe import Dispatched
from services.scheduler.redis_guard import RedisGuard
from shared.redis_conn import connect_redis


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[Server]:
    server = start_redis(free_port(), tmp_path / "redis")  # no persistence: a restart comes back empty
    yield server
    server.stop()


async def test_markers_made_while_redis_was_away_reach_it_when_it_answers(restartable_redis: Server) -> None:
    here = Dispatched(connect_redis(restartable_redis.url), RedisGuard(retry_s=0.05), "o:", ttl_s=60)
    restartable_redis.stop()
    assert await here.mark("acme", "during", 5)  # dispatched on the local fallback
    assert here.unsynced == 1
    restartable_redis.start()
    await asyncio.sleep(0.1)  # past the guard's retry
    assert await here.mark("acme", "after", 6)
    assert here.unsynced == 0
    other = Dispatched(connect_redis(restartable_redis.url), RedisGuard(), "o:", ttl_s=60)  # another scheduler
    assert await other.seen("acme", "during") and await other.seen("acme", "after")
    assert await other.same_submission("acme", "during", 5)  # the redelivery: acknowledged, not run
    assert not await other.same_submission("acme", "during", 9)  # a new submission reusing the id
    assert not await other.mark("acme", "during", 5)


async def test_a_marker_another_scheduler_wrote_meanwhile_is_not_overwritten(restartable_redis: Server) -> None:
    here = Dispatched(connect_redis(restartable_redis.url), RedisGuard(retry_s=0.05), "p:", ttl_s=60)
    restartable_redis.stop()
    await here.mark("acme", "both", 5)
    restartable_redis.start()
    other = Dispatched(connect_redis(restartable_redis.url), RedisGuard(), "p:", ttl_s=60)
    assert await other.mark("acme", "both", 8)
    await asyncio.sleep(0.1)
    await here.mark("acme", "next", 6)
    assert await other.same_submission("acme", "both", 8) and not await other.same_submission("acme", "both", 5)
