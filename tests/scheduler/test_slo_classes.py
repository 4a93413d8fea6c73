"""SLO classes at the scheduler: a request's class is bounded by its tenant's tier, carried to the
worker with its TTFT target, queued by class, and shed at admission (429 overloaded + Retry-After)
when the fleet's measured service says it would miss its target. On a real Dispatcher and Redis."""

import time

import pytest

from services.scheduler.settings import SchedulerSettings
from services.scheduler.shedding import LoadShedder
from shared.config import SloTargets
from shared.errors import Overloaded
from shared.redis_conn import connect_redis
from shared.schemas import TenantQuota
from tests.scheduler.test_dispatcher import World

TARGETS = SloTargets(interactive=5.0, standard=15.0, batch=30.0)


@pytest.fixture
async def world(redis_url):
    redis = connect_redis(redis_url)
    settings = SchedulerSettings(
        capacity_headroom=0,
        liveness_timeout_s=5,
        slo_ttft_s=TARGETS,
        redis_key_prefix=f"slo{time.monotonic_ns()}:",
        default_quota={"max_concurrent": 0, "requests_per_min": 0, "tokens_per_min": 0},
    )
    yield World(settings, redis)
    await redis.aclose()


def measured(shedder: LoadShedder, service_s: float, worker_ttft_s: float = 0.0) -> None:
    """The shedder as if ``min_samples`` requests had each taken ``service_s`` on a worker."""
    for _ in range(shedder.min_samples):
        shedder.ended(service_s, worker_ttft_s)


async def test_a_request_runs_in_its_tenants_tier_unless_it_asks_for_a_lower_class(world):
    world.beat("w1")
    await world.submit("default")
    await world.submit("lower", priority="batch")
    assert world.requests["default"].priority == "standard"  # the platform's default tier
    assert world.requests["default"].ttft_target_s == TARGETS.standard
    assert (world.requests["lower"].priority, world.requests["lower"].ttft_target_s) == ("batch", TARGETS.batch)


async def test_a_client_cannot_raise_its_priority_above_its_tier(world):
    world.beat("w1")
    msg = await world.submit("raised", priority="interactive")
    assert msg.acts == ["term"] and world.errors == {"raised": "priority_not_allowed"}
    assert "raised" not in world.requests  # never dispatched, not even at a lower class
    world.core.quotas.set("acme", TenantQuota(slo_tier="interactive"))  # a platform admin raises the tier
    await world.submit("allowed", priority="interactive")
    await world.submit("tier", tenant="acme")
    assert world.requests["allowed"].priority == "interactive" and world.requests["tier"].priority == "interactive"
    world.core.quotas.set("acme", TenantQuota(slo_tier="batch"))
    assert (await world.submit("standard", priority="standard")).acts == ["term"]
    assert world.errors["standard"] == "priority_not_allowed"


async def test_queued_requests_go_by_class_not_by_arrival(world):
    world.core.quotas.set("acme", TenantQuota(slo_tier="interactive"))
    world.beat("w1", max_running=1)
    await world.submit("running")
    for rid, cls in (("b", "batch"), ("s", "standard"), ("i", "interactive")):
        await world.submit(rid, priority=cls)
    order = []
    for _ in range(3):
        await world.finish(([rid for _, rid in world.dispatched])[-1])
        world.beat("w1", max_running=1)
        world.core.pump()
        await world.settle()
        order.append(world.dispatched[-1][1])
    assert order == ["i", "s", "b"]


async def test_past_its_measured_capacity_the_scheduler_refuses_at_once_what_would_miss_its_target(world):
    world.core.quotas.set("acme", TenantQuota(slo_tier="interactive"))
    world.beat("w1", max_running=1)
    await world.submit("running", priority="interactive")
    measured(world.core.shedder, service_s=2.0)  # one running, 2 s each: 0.5 requests/s
    # queued interactive requests wait 2 s per request ahead of them: the target (5 s) admits two
    for i in range(2):
        assert (await world.submit(f"i{i}", priority="interactive")).acts == [], world.errors
    started = time.monotonic()
    shed = await world.submit("i2", priority="interactive")
    assert time.monotonic() - started < 0.5  # refused in the admission, not after a wait
    assert shed.acts == ["term"] and world.errors["i2"] == "overloaded"
    # a class with a longer target is still admitted behind them
    assert (await world.submit("s0", priority="standard")).acts == []
    assert "s0" not in world.errors


async def test_the_refusal_carries_a_retry_after_from_the_estimate(world):
    shedder = world.core.shedder
    measured(shedder, service_s=1.0, worker_ttft_s=0.5)
    now = time.monotonic()
    with pytest.raises(Overloaded) as refused:
        shedder.check("interactive", ahead=9, free=0, running=1, now=now)  # 10 s wait + 0.5 s
    # admitted while within 80% of the target: Retry-After is what stands above that
    assert refused.value.status == 429
    assert refused.value.retry_after_s == pytest.approx(10.5 - 0.8 * TARGETS.interactive)
    shedder.check("interactive", ahead=0, free=1, running=1, now=now)  # a worker has room: no wait


def test_a_burst_is_admitted_up_to_the_free_sequences_before_any_of_it_is_dispatched():
    """30 arrive at once on 6 free sequences: the 6th finds 5 admitted ahead of it, still queued (the
    pump has not dispatched them yet), and will not wait; the 7th would."""
    shedder = LoadShedder(SloTargets(interactive=0.05, standard=0.05, batch=0.05), min_samples=1)
    shedder.ended(service_s=1.0, worker_ttft_s=0.0)
    for ahead in range(6):
        shedder.check("interactive", ahead=ahead, free=6, running=0, now=0.0)
    with pytest.raises(Overloaded):
        shedder.check("interactive", ahead=6, free=6, running=6, now=0.0)


def test_the_wait_before_admission_counts_against_the_target():
    shedder = LoadShedder(TARGETS, min_samples=1)
    shedder.ended(service_s=1.0, worker_ttft_s=0.0)
    shedder.check("interactive", ahead=0, free=0, running=1, now=0.0)  # 1 s of queue: within 4 s
    with pytest.raises(Overloaded):  # the same, after 3.5 s in the scheduler's intake
        shedder.check("interactive", ahead=0, free=0, running=1, now=0.0, waited_s=3.5)


def test_a_long_class_target_is_cut_to_the_clients_accept_deadline():
    shedder = LoadShedder(TARGETS, min_samples=1)
    shedder.ended(service_s=1.0, worker_ttft_s=0.0)
    shedder.check("batch", ahead=9, free=0, running=1, now=0.0)  # 10 s of queue: within 30 s
    with pytest.raises(Overloaded):  # but its client stops waiting for a worker in 8 s: refused now, not a 503 then
        shedder.check("batch", ahead=9, free=0, running=1, now=0.0, patience_s=8.0)


def test_batch_is_shed_first_when_higher_classes_take_the_capacity():
    shedder = LoadShedder(TARGETS, min_samples=1)
    shedder.ended(service_s=1.0, worker_ttft_s=0.0)
    now = 100.0
    for i in range(90):  # interactive arriving at 3 requests/s, faster than 2 running serve them
        shedder.admitted("interactive", now - 30 + i / 3)
    estimates = {c: shedder.estimate(c, ahead=1, free=0, running=2, now=now) for c in ("interactive", "batch")}
    assert estimates["interactive"].ttft_s == pytest.approx(1.0)  # 2 ahead-or-self at 2 requests/s
    assert estimates["batch"].ttft_s > TARGETS.batch  # nothing is left to it: refused despite its long target
    shedder.check("interactive", ahead=1, free=0, running=2, now=now)
    with pytest.raises(Overloaded):
        shedder.check("batch", ahead=1, free=0, running=2, now=now)


def test_nothing_is_shed_before_the_service_is_measured_or_when_shedding_is_off():
    shedder = LoadShedder(TARGETS, min_samples=4)
    for _ in range(3):
        shedder.ended(60.0, 0.0)
    shedder.check("interactive", ahead=1000, free=0, running=1, now=0.0)  # 3 samples: no estimate yet
    off = LoadShedder(TARGETS, enabled=False, min_samples=1)
    off.ended(60.0, 0.0)
    off.check("interactive", ahead=1000, free=0, running=1, now=0.0)


def test_slo_targets_may_not_shrink_down_the_classes():
    with pytest.raises(ValueError, match="must not shrink"):
        SloTargets(interactive=10, standard=5, batch=60)
