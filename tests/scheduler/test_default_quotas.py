"""Platform default quotas (``LF_DEFAULT_QUOTA__*``): every tenant without a quota of its own is
limited, on a real Dispatcher and a real Redis; 0 is the explicit way to say unlimited."""

import time

import pytest

from services.scheduler.limits import Quotas
from services.scheduler.settings import SchedulerSettings
from shared.redis_conn import connect_redis
from shared.schemas import TenantQuota
from tests.scheduler.test_dispatcher import World


@pytest.fixture
async def redis(redis_url):
    redis = connect_redis(redis_url)
    yield redis
    await redis.aclose()


def settings(**over) -> SchedulerSettings:
    return SchedulerSettings(capacity_headroom=0, redis_key_prefix=f"q{time.monotonic_ns()}:", **over)


async def flood(world: World, tenant: str, n: int) -> list[str]:
    """``n`` submissions with no worker to take them; each one's fate: held, or its refusal code."""
    fates = []
    for i in range(n):
        msg = await world.submit(f"{tenant}-{i}", tenant=tenant)
        fates.append(world.errors.get(f"{tenant}-{i}", "held") if msg.acts in ([], ["term"]) else str(msg.acts))
    return fates


def test_every_default_limit_is_on_out_of_the_box() -> None:
    quota = Quotas.from_settings(SchedulerSettings()).of("anyone")
    assert all(value for _, value in quota), quota


async def test_a_tenant_without_a_quota_is_held_to_the_platform_concurrency(redis) -> None:
    world = World(settings(), redis)
    limit = SchedulerSettings().default_quota.max_concurrent
    fates = await flood(world, "newcomer", limit + 3)
    assert fates == ["held"] * limit + ["quota_exceeded"] * 3


async def test_the_defaults_come_from_the_environment(redis, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LF_DEFAULT_QUOTA__MAX_CONCURRENT", "2")
    monkeypatch.setenv("LF_DEFAULT_QUOTA__REQUESTS_PER_MIN", "0")
    configured = settings()
    assert configured.default_quota.max_concurrent == 2 and configured.default_quota.requests_per_min == 0
    assert await flood(World(configured, redis), "acme", 3) == ["held", "held", "quota_exceeded"]


async def test_a_partial_quota_keeps_the_defaults_it_leaves_unset_and_zero_means_unlimited(redis) -> None:
    world = World(settings(), redis)
    limit = SchedulerSettings().default_quota.max_concurrent
    world.core.quotas.set("partial", TenantQuota(requests_per_min=10_000))
    world.core.quotas.set("unbounded", TenantQuota(max_concurrent=0))
    assert (await flood(world, "partial", limit + 1))[-1] == "quota_exceeded"
    assert await flood(world, "unbounded", limit + 5) == ["held"] * (limit + 5)
