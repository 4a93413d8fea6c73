"""Fields a direct-NATS client writes that only the scheduler may set: they never lift a quota."""

import time

from shared.config import DefaultQuota
from shared.schemas import TenantQuota


async def test_a_client_written_created_at_frees_no_slot_while_the_request_runs(world):
    world.beat("w1", max_running=64)
    world.core.quotas.set("acme", TenantQuota(max_concurrent=1))
    acts = []
    for i in range(20):
        acts.append((await world.submit(f"r{i}", created_at=0.0)).acts)
        await world.upkeep.tick()
    assert acts == [["ack"]] + [["term"]] * 19
    assert list(world.core.inflight) == [("acme", "r0")] and world.core.fleet.workers["w1"].inflight == 1
    assert abs(world.requests["r0"].created_at - time.time()) < 60  # the scheduler's stamp reaches the worker


async def test_a_client_written_gpu_slot_quota_is_replaced_by_the_tenants(world):
    world.beat("w1")
    await world.submit("default", tenant_gpu_slots=100_000)  # no quota of its own: the platform default
    world.core.quotas.set("acme", TenantQuota(max_gpu_adapter_slots=2))
    await world.submit("capped", tenant_gpu_slots=100_000)
    world.core.quotas.set("acme", TenantQuota(max_gpu_adapter_slots=0))  # 0: no limit
    await world.submit("unlimited", tenant_gpu_slots=3)
    slots = [world.requests[r].tenant_gpu_slots for r in ("default", "capped", "unlimited")]
    assert slots == [DefaultQuota().max_gpu_adapter_slots, 2, None]


async def test_a_client_written_soft_slot_enforcement_is_replaced_by_the_tenants_hard_one(world):
    world.beat("w1")
    world.core.quotas.set("acme", TenantQuota(max_gpu_adapter_slots=1, enforce="hard"))
    await world.submit("hard", tenant_slot_enforce="soft")
    world.core.quotas.set("acme", TenantQuota(max_gpu_adapter_slots=1))
    await world.submit("soft", tenant_slot_enforce="hard")
    enforced = [(world.requests[r].tenant_gpu_slots, world.requests[r].tenant_slot_enforce) for r in ("hard", "soft")]
    assert enforced == [(1, "hard"), (1, "soft")]


async def test_a_submission_past_its_accept_deadline_is_refused_typed_not_run(world):
    world.beat("w1")
    msg = await world.submit("late", accept_deadline=time.time() - 1)
    assert msg.acts == ["term"]
    assert world.errors == {"late": "upstream_timeout"}  # answered, not silently dropped
    assert "late" not in world.requests and ("acme", "late") not in world.core.held


async def test_a_queued_request_past_its_accept_deadline_is_answered_audited_and_frees_its_slot(world):
    """Before: the queue sweep dropped it silently (no reply, no audit record)."""
    audited: list[tuple[str, str, str]] = []

    async def record_rejection(tenant: str, rid: str, err) -> None:
        audited.append((tenant, rid, err.code))

    world.core.ports.record_rejection = record_rejection
    world.beat("w1", max_running=1)
    world.core.quotas.set("acme", TenantQuota(max_concurrent=2))
    await world.submit("busy")
    late = await world.submit("late", accept_deadline=time.time() + 60)  # queued: w1 runs one at a time
    queued = world.core.held[("acme", "late")]
    queued.request = queued.request.model_copy(update={"accept_deadline": time.time() - 1})  # its client gave up
    await world.upkeep.sweep_queue(time.monotonic())
    assert late.acts == ["term"] and ("acme", "late") not in world.core.held and len(world.core.queue) == 0
    assert world.errors == {"late": "upstream_timeout"} and audited == [("acme", "late", "upstream_timeout")]
    after = await world.submit("after")  # the late request's concurrency slot is free again
    assert after.acts == [] and ("acme", "after") in world.core.held and "after" not in world.errors


async def test_a_client_written_ttft_target_is_replaced_by_its_classs(world):
    world.beat("w1")
    await world.submit("lax", ttft_target_s=3600.0, priority="batch")  # a target it would always meet
    assert world.requests["lax"].ttft_target_s == world.core.shedder.targets.batch
