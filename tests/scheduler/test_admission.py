import asyncio
import time

import pytest

from lorafleet.cli.infra import free_port
from services.scheduler.admission import Admission, AlreadyDispatched, token_cost
from services.scheduler.dedupe import Dispatched
from services.scheduler.limiter import LocalLimiter
from services.scheduler.redis_guard import RedisGuard
from shared.errors import QuotaExceeded
from shared.redis_conn import connect_redis
from shared.schemas import InferRequest, TenantQuota

BASE = "base"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def req(rid: str, tenant: str = "acme", max_tokens: int = 10, prompt: str = "x" * 40) -> InferRequest:
    return InferRequest(
        request_id=rid,
        tenant_id=tenant,
        model=BASE,
        base_model=BASE,
        prompt=prompt,
        reply_to="_INBOX.a",
        sampling={"max_tokens": max_tokens},
    )


@pytest.fixture(params=["redis", "local"])
async def admission(request, redis_url):
    """The Lua scripts on a real Redis, and the local limiter behind an unreachable one."""
    url = redis_url if request.param == "redis" else f"redis://127.0.0.1:{free_port()}/0"
    redis = connect_redis(url)
    await redis.flushdb() if request.param == "redis" else None
    adm = Admission(redis, RedisGuard(), f"t{time.monotonic_ns()}:", lease_s=1.0)
    yield adm
    await redis.aclose()


async def test_requests_per_minute_refuse_with_retry_after_then_refill(admission):
    quota = TenantQuota(requests_per_min=120)  # 2 per second
    grants = [await admission.admit(req(f"r{i}"), quota) for i in range(120)]
    assert len(grants) == 120
    with pytest.raises(QuotaExceeded) as refused:
        await admission.admit(req("over"), quota)
    assert refused.value.status == 429 and 0 < refused.value.retry_after_s <= 0.6
    await asyncio.sleep(refused.value.retry_after_s + 0.05)
    await admission.admit(req("later"), quota)


async def test_tokens_are_charged_up_front_and_the_unused_part_refunded(admission):
    quota = TenantQuota(tokens_per_min=100)
    cost = sum(token_cost(req("a", max_tokens=40)))
    assert cost == 50
    first = await admission.admit(req("a", max_tokens=40), quota)
    await admission.admit(req("b", max_tokens=40), quota)
    with pytest.raises(QuotaExceeded):
        await admission.admit(req("c", max_tokens=40), quota)
    await admission.release(first, used_tokens=15)  # 35 unused tokens come back
    with pytest.raises(QuotaExceeded):
        await admission.admit(req("d", max_tokens=40), quota)  # 50 > 35 + refill
    await admission.admit(req("e", max_tokens=20), quota)


async def test_a_request_larger_than_the_minute_waits_for_a_full_bucket_then_owes_the_rest(admission):
    quota = TenantQuota(tokens_per_min=100)
    grant = await admission.admit(req("huge", max_tokens=3490), quota)  # 35 minutes' worth
    assert grant.tokens == 3500
    with pytest.raises(QuotaExceeded) as refused:
        await admission.admit(req("next", max_tokens=1, prompt="x"), quota)
    # the 3,400-token debt is paid off at 100 a minute before even a 2-token request goes in
    assert 34 * 60 - 5 < refused.value.retry_after_s < 35 * 60


async def test_tokens_used_beyond_the_charge_are_owed_not_forgiven(admission):
    quota = TenantQuota(tokens_per_min=1000)
    grant = await admission.admit(req("a", max_tokens=40), quota)  # charged 50 up front
    await admission.release(grant, used_tokens=35_000)  # it really used 35 minutes' worth
    with pytest.raises(QuotaExceeded) as refused:
        await admission.admit(req("b", max_tokens=1, prompt="x"), quota)
    assert refused.value.retry_after_s > 33 * 60


async def test_a_debt_outlives_the_two_minutes_a_full_bucket_is_kept(redis_url):
    redis = connect_redis(redis_url)
    prefix = f"debt{time.monotonic_ns()}:"
    try:
        adm = Admission(redis, RedisGuard(), prefix, lease_s=1.0)
        await adm.admit(req("huge", max_tokens=3490), TenantQuota(tokens_per_min=100))
        assert await redis.ttl(f"{prefix}quota:acme:tpm") > 34 * 60  # kept until the refill pays it off
    finally:
        await redis.aclose()


async def test_concurrency_cap_frees_on_release_and_a_lost_release_expires(admission):
    quota = TenantQuota(max_concurrent=2)
    a = await admission.admit(req("a"), quota)
    await admission.admit(req("b"), quota)
    with pytest.raises(QuotaExceeded) as refused:
        await admission.admit(req("c"), quota)
    assert refused.value.retry_after_s >= 1
    await admission.admit(req("x", tenant="other"), quota)  # tenants are separate
    await admission.release(a, used_tokens=None)
    await admission.admit(req("c"), quota)
    await asyncio.sleep(1.1)  # nobody renewed b and c: their leases lapse
    await admission.admit(req("d"), quota)
    await admission.admit(req("e"), quota)


async def test_renewed_leases_keep_their_slot(admission):
    quota = TenantQuota(max_concurrent=1)
    grant = await admission.admit(req("a"), quota)
    for _ in range(3):
        await asyncio.sleep(0.5)
        await admission.renew([grant])
    with pytest.raises(QuotaExceeded):
        await admission.admit(req("b"), quota)


async def test_redis_going_away_falls_back_to_the_local_limiter_quickly(redis_url):
    redis = connect_redis(f"redis://127.0.0.1:{free_port()}/0")
    guard = RedisGuard(retry_s=0.2)
    adm = Admission(redis, guard, "x:", lease_s=5)
    start = time.monotonic()
    grants = [await adm.admit(req(f"r{i}"), TenantQuota(requests_per_min=3)) for i in range(3)]
    with pytest.raises(QuotaExceeded):
        await adm.admit(req("r4"), TenantQuota(requests_per_min=3))
    assert time.monotonic() - start < 2 and not any(g.in_redis for g in grants)
    assert not guard.healthy
    await redis.aclose()


def test_local_limiter_matches_the_lua_semantics_on_its_own_clock():
    clock = Clock()
    limiter = LocalLimiter(lease_s=10, clock=clock)
    quota = TenantQuota(requests_per_min=60, max_concurrent=1)
    limiter.admit("t", "a", quota, 1)
    with pytest.raises(QuotaExceeded):
        limiter.admit("t", "b", quota, 1)
    clock.now += 11  # the lease lapsed and a request refilled
    limiter.admit("t", "b", quota, 1)


async def test_a_dispatched_request_is_recognised_in_the_same_round_trip_and_charged_nothing(redis_url):
    redis = connect_redis(redis_url)
    prefix = f"d{time.monotonic_ns()}:"
    adm = Admission(redis, RedisGuard(), prefix, lease_s=1.0)
    dispatched = Dispatched(redis, RedisGuard(), prefix, ttl_s=60)
    quota = TenantQuota(requests_per_min=60, max_concurrent=1)
    try:
        await dispatched.mark("acme", "taken", 1)
        with pytest.raises(AlreadyDispatched):
            await adm.admit(req("taken"), quota, dispatched.key("acme", "taken"))
        grant = await adm.admit(req("fresh"), quota, dispatched.key("acme", "fresh"))  # nothing was charged above
        assert grant.in_redis and grant.request_id == "fresh"
        assert await redis.zcard(f"{prefix}quota:acme:running") == 1
    finally:
        await redis.aclose()


async def test_a_charge_takes_one_request_of_the_minute_and_nothing_else(admission):
    """A request that runs no model (a feedback post, issue 47) counts against requests per minute
    and holds no token and no concurrency slot."""
    quota = TenantQuota(requests_per_min=2, tokens_per_min=100, max_concurrent=1)
    await admission.charge("acme", quota)
    grant = await admission.admit(req("r1", max_tokens=10), quota)  # the one concurrency slot is still free
    assert grant.tokens == sum(token_cost(req("r1", max_tokens=10)))
    with pytest.raises(QuotaExceeded, match="requests") as refused:
        await admission.charge("acme", quota)
    assert refused.value.retry_after_s and refused.value.retry_after_s > 0
    await admission.charge("globex", quota)  # another tenant's minute is its own
