"""Request ids are per tenant: one tenant's id never shadows another's, and a tenant reusing its own
id is told so (409) while a redelivery of the same submission is acknowledged, never run twice."""

from services.scheduler.settings import SchedulerSettings
from shared.errors import RequestIdInUse, from_body
from shared.redis_conn import connect_redis
from shared.request_ref import RequestRef
from tests.scheduler.test_dispatcher import World


async def test_another_tenants_earlier_id_does_not_swallow_the_victims_request(world):
    world.beat("w1")
    await world.submit("predictable", tenant="attacker", seq=1)
    await world.finish("predictable", tenant="attacker")
    victim = await world.submit("predictable", tenant="victim", seq=2)
    assert victim.acts == ["ack"] and world.dispatched == [("w1", "predictable")] * 2
    assert world.requests["predictable"].tenant_id == "victim"


async def test_a_second_scheduler_keeps_the_ids_per_tenant_through_redis(world, redis_url):
    world.beat("w1")
    await world.submit("r1", tenant="attacker", seq=1)
    redis = connect_redis(redis_url)
    try:
        settings = SchedulerSettings(capacity_headroom=0, redis_key_prefix=world.core.admission._prefix)
        peer = World(settings, redis)  # knows nothing in process: only Redis remembers r1
        peer.beat("w2")
        assert (await peer.submit("r1", tenant="attacker", seq=1)).acts == ["ack"]  # a redelivery
        assert (await peer.submit("r1", tenant="attacker", seq=5)).acts == ["term"]  # a reuse
        assert peer.errors == {"r1": "request_id_in_use"}
        assert (await peer.submit("r1", tenant="victim", seq=6)).acts == ["ack"]
        assert peer.dispatched == [("w2", "r1")] and peer.requests["r1"].tenant_id == "victim"
    finally:
        await redis.aclose()


async def test_a_tenant_reusing_its_own_id_gets_409_and_its_redelivery_is_acked(world):
    world.beat("w1")
    await world.submit("r1", seq=1)
    assert (await world.submit("r1", seq=1)).acts == ["ack"]  # redelivered: runs once
    reused = await world.submit("r1", seq=7, reply_to="_INBOX.other")  # running: a new submission
    assert reused.acts == ["term"] and world.errors == {"r1": RequestIdInUse.code}
    await world.finish("r1")
    world.errors.clear()
    late = await world.submit("r1", seq=9, reply_to="_INBOX.late")  # served already: still in use
    assert late.acts == ["term"] and world.errors == {"r1": "request_id_in_use"}
    assert world.dispatched == [("w1", "r1")]


def test_the_reuse_error_is_a_409_through_the_error_body():
    rebuilt = from_body(RequestIdInUse("request id r1 is in use").to_body())
    assert isinstance(rebuilt, RequestIdInUse) and rebuilt.status == 409


async def test_two_tenants_hold_one_id_at_once_and_each_run_ends_only_its_own(world):
    """Before: the in-flight maps were keyed by request id alone, so the second tenant got a 409."""
    world.beat("w1")
    first = await world.submit("same", tenant="a", seq=1)
    second = await world.submit("same", tenant="b", seq=2)
    assert first.acts == second.acts == ["ack"] and world.errors == {}
    assert world.dispatched == [("w1", "same")] * 2
    assert set(world.core.inflight) == {("a", "same"), ("b", "same")}
    await world.finish("same", tenant="a")
    assert set(world.core.inflight) == {("b", "same")} and world.core.fleet.workers["w1"].inflight == 1
    await world.finish("same", tenant="b")
    assert not world.core.inflight and world.core.fleet.workers["w1"].inflight == 0


async def test_a_cancel_of_one_tenants_queued_request_leaves_the_other_tenants_under_the_same_id(world):
    world.beat("w1", max_running=1)
    await world.submit("busy", seq=1)
    mine = await world.submit("same", tenant="a", seq=2)  # both queued: w1 runs one at a time
    theirs = await world.submit("same", tenant="b", seq=3)
    assert not await world.core.cancel(RequestRef("c", "same"))  # nobody's request of c's
    assert await world.core.cancel(RequestRef("a", "same"))
    assert mine.acts == ["term"] and theirs.acts == [] and set(world.core.held) == {("b", "same")}
    await world.finish("busy")
    assert theirs.acts == ["ack"] and world.errors == {}
