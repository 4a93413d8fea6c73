"""Two schedulers on one Redis: the fairness counters and the dispatch claims are global, so a
tenant's fair share holds across instances and a submission redelivered to the other one never runs
twice (real Redis; fake workers and inboxes around real Dispatchers)."""

import asyncio
import time
from collections import Counter

import pytest

from services.scheduler.settings import SchedulerSettings
from services.scheduler.vtc import QUIET_PERIODS
from shared.config import DefaultQuota
from shared.errors import ServiceUnavailable
from shared.redis_conn import connect_redis
from shared.schemas import DispatchReply, InferRequest
from tests.scheduler.test_dispatcher import World

FLOOD, LIGHT = "flood", "light"
ROUNDS = 16


@pytest.fixture
async def redis(redis_url):
    client = connect_redis(redis_url)
    yield client
    await client.aclose()


def schedulers(redis, n: int) -> list[World]:
    """``n`` schedulers of one fleet: one Redis key prefix."""
    settings = SchedulerSettings(
        capacity_headroom=0,
        liveness_timeout_s=5,
        redis_key_prefix=f"r{time.monotonic_ns()}:",
        default_quota=DefaultQuota(requests_per_min=0, tokens_per_min=0, max_concurrent=0),  # floods, not quotas
    )
    return [World(settings, redis) for _ in range(n)]


async def hand_off(worlds: list[World]) -> None:
    for world in worlds:
        assert await world.upkeep.counters.hand_off()


async def served_share(worlds: list[World], slots: int, light_via: list[World]) -> tuple[float, dict[str, float]]:
    """Flood the worlds with one tenant's requests and send a light tenant's through ``light_via``;
    serve ``ROUNDS`` rounds (each world's worker ends what it runs, counters handed off after each
    round): the light tenant's share of the dispatches made, and the counters its world ended with."""
    for world in worlds:
        for i in range(3 * ROUNDS):
            await world.submit(f"{FLOOD}-{id(world)}-{i}", tenant=FLOOD)
    for world in light_via:
        for i in range(ROUNDS):
            await world.submit(f"{LIGHT}-{id(world)}-{i}", tenant=LIGHT)
    await hand_off(worlds)
    for world in worlds:
        world.beat("w", max_running=slots)
        world.core.pump()
        await world.settle()
    for _ in range(ROUNDS):
        for world in worlds:
            for ref in list(world.core.inflight):
                await world.finish(ref.request_id, ref.tenant)
        await hand_off(worlds)
    dispatched = Counter(rid.split("-")[0] for world in worlds for _, rid in world.dispatched)
    return dispatched[LIGHT] / sum(dispatched.values()), light_via[0].core.queue.counters


async def test_a_light_tenant_gets_the_share_one_scheduler_gives_it_when_two_share_the_flood(redis):
    # one scheduler, two worker slots: the light tenant is served as often as the flooding one
    (one,) = schedulers(redis, 1)
    alone, _ = await served_share([one], 2, [one])
    # two schedulers, one slot each, the flood through both and the light tenant's through one: with
    # per-instance counters that one alternates the two tenants and the other serves the flood alone
    a, b = schedulers(redis, 2)
    shared, counters = await served_share([a, b], 1, [b])
    assert alone == pytest.approx(0.5, abs=0.05)
    assert shared == pytest.approx(alone, abs=0.08)
    # what both schedulers charged the tenants is one ledger: level, to within one request's charge
    assert counters[FLOOD] == pytest.approx(counters[LIGHT], abs=2 * 18)


async def test_a_tenant_backlogged_at_another_scheduler_is_not_lifted_and_one_returning_from_idle_is(redis):
    a, b = schedulers(redis, 2)
    a.core.queue.charge(FLOOD, 0, 500)
    await a.submit("f1", tenant=FLOOD)  # no worker: it stays queued, its tenant backlogged at a
    await a.submit("l1", tenant=LIGHT)
    await hand_off([a, b])
    b.core.queue.charge(LIGHT, 0, 50)
    await hand_off([a, b])
    await b.submit("f2", tenant=FLOOD)  # backlogged at a: b adopts its counter, nothing is lifted
    await b.submit("n1", tenant="newcomer")  # idle everywhere: lifted to the lowest active counter
    await hand_off([a, b])
    counters = b.core.queue.counters
    assert counters[FLOOD] == 2 * 500
    assert counters["newcomer"] == counters[LIGHT] == 2 * 50


async def test_charges_made_while_redis_is_away_are_added_when_it_answers_again(redis):
    a, b = schedulers(redis, 2)
    await a.submit("f1", tenant=FLOOD)
    await b.submit("f2", tenant=FLOOD)
    a.upkeep.counters._guard._down_until = time.monotonic() + 60  # as after a failed call
    a.core.queue.charge(FLOOD, 0, 100)
    assert not await a.upkeep.counters.hand_off()
    assert a.core.queue.counters[FLOOD] == 200  # it orders on its own counter meanwhile
    a.upkeep.counters._guard._down_until = 0.0
    await hand_off([a, b])
    assert b.core.queue.counters[FLOOD] == 200


async def test_a_submission_redelivered_to_the_other_scheduler_mid_dispatch_is_not_dispatched_again(redis):
    a, b = schedulers(redis, 2)
    a.beat("w1")
    b.beat("w1")
    accepting = asyncio.Event()
    worker_has_it = asyncio.Event()
    took: list[str] = []

    async def slow_worker(worker_id: str, request: InferRequest, headers) -> DispatchReply:
        took.append(request.request_id)
        worker_has_it.set()
        await accepting.wait()  # the worker took it; the scheduler dies before it hears so
        return DispatchReply(accepted=True, worker_id=worker_id)

    a.core.ports.dispatch = slow_worker
    first = asyncio.create_task(a.submit("r1", seq=7))
    await worker_has_it.wait()
    redelivered = await b.submit("r1", seq=7)  # its ack wait ran out: JetStream hands it to b
    assert b.dispatched == [] and redelivered.acts == ["ack"]
    accepting.set()
    await first
    assert took == ["r1"]
    # a new submission reusing the id is refused as in use, at either scheduler
    reused = await b.submit("r1", seq=8)
    assert reused.acts == ["term"] and b.errors["r1"] == "request_id_in_use"


async def test_a_claim_no_worker_took_is_released_so_the_other_scheduler_can_run_it(redis):
    a, b = schedulers(redis, 2)
    a.beat("w1")
    a.answers["w1"] = ServiceUnavailable("queue full")
    await a.submit("r1", seq=3)
    assert a.dispatched == [("w1", "r1")] and "r1" in {r.request_id for r in a.core.held}
    b.beat("w2")
    redelivered = await b.submit("r1", seq=3)
    assert b.dispatched == [("w2", "r1")] and redelivered.acts == ["ack"]


async def _hand_offs(redis) -> int:
    """The hand-off scripts Redis has run (its own command count)."""
    return (await redis.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)


async def test_a_quiet_scheduler_reads_the_floor_rarely_and_hands_off_within_a_period_once_busy(redis):
    (world,) = schedulers(redis, 1)
    counters = world.upkeep.counters
    counters.period_s = 0.02
    await counters.hand_off()  # the script is loaded: EVALSHA from here on
    running = asyncio.create_task(counters.run())
    try:
        before = await _hand_offs(redis)
        await asyncio.sleep(1.0)  # 50 periods, quiet: one hand-off in QUIET_PERIODS
        quiet = await _hand_offs(redis) - before
        assert quiet >= 1  # the floor is still read
        assert quiet <= 50 / QUIET_PERIODS + 2, f"{quiet} hand-offs in 50 quiet periods: one a period"
        world.core.queue.charge("t", 10, 10)
        busy_from = await _hand_offs(redis)
        await asyncio.sleep(5 * counters.period_s)
        assert await _hand_offs(redis) > busy_from  # a charge goes out at the next period, not a quiet one later
        await world.submit("r1", tenant="t")  # no worker: queued here, which keeps it busy: every period
        assert not world.core.queue.quiet()
        busy_from = await _hand_offs(redis)
        await asyncio.sleep(0.5)
        assert await _hand_offs(redis) - busy_from > 0.5 / counters.period_s / QUIET_PERIODS + 2  # more than quiet
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
