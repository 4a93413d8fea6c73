"""Intake fairness: submissions are admitted one per tenant per turn, so a flood from one tenant
does not hold another's request behind it. The service test runs the scheduler's real consume loop
on a real nats-server (INFER work queue) and a real Redis, with no worker: what it shows is the
order of admission, which no machine's speed changes."""

import asyncio
import contextlib
import time

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from services.scheduler.dispatcher import Ports
from services.scheduler.service import Scheduler, build
from services.scheduler.settings import SchedulerSettings
from services.scheduler.waiting import Intake
from shared import subjects
from shared.bus import encode, ensure_streams
from shared.config import StreamLimits
from shared.errors import LorafleetError
from shared.redis_conn import connect_redis
from shared.schemas import DispatchReply, InferRequest, TenantQuota

BASE = "base"
MAX_INFLIGHT = 16


def test_tenants_take_turns_and_each_keeps_its_own_order() -> None:
    intake: Intake[str] = Intake(per_tenant=10)
    for i in range(5):
        intake.push("flood", f"f{i}", 0.0)
    intake.push("quiet", "q0", 0.0)
    assert [intake.pop() for _ in range(4)] == ["f0", "q0", "f1", "f2"]
    assert intake.pop(lambda tenant: tenant != "flood") is None and len(intake) == 2


def test_a_full_tenant_queue_refuses_only_that_tenant() -> None:
    intake: Intake[str] = Intake(per_tenant=2)
    assert intake.push("a", "a0", 0.0) and intake.push("a", "a1", 0.0)
    assert not intake.push("a", "a2", 0.0)
    assert intake.push("b", "b0", 0.0)


def test_waiting_items_are_reported_for_keep_alive_once_per_period() -> None:
    intake: Intake[str] = Intake(per_tenant=4)
    intake.push("a", "old", 0.0)
    intake.push("a", "new", 9.0)
    assert intake.stale(10.0, 5.0) == ["old"]
    assert intake.stale(12.0, 5.0) == []  # kept alive at 10


class Run:
    """The scheduler's consume loop over a real INFER stream; records the order of admission."""

    def __init__(self, nc, redis, refusals: dict[str, str]) -> None:
        async def dispatch(worker_id: str, request: InferRequest, headers) -> DispatchReply:
            raise AssertionError("no worker beats: nothing is dispatched")

        async def reply_error(reply_to: str, request_id: str, err: LorafleetError) -> None:
            refusals[request_id] = err.code

        async def nothing(*_) -> None:
            return None

        settings = SchedulerSettings(redis_key_prefix=f"in{time.monotonic_ns()}:", no_worker_grace_s=60)
        core, upkeep = build(settings, Ports(dispatch, reply_error, nothing, nothing), redis)
        core.quotas.set("flood", TenantQuota(requests_per_min=0, tokens_per_min=0, max_concurrent=0))
        self.core = core
        self.scheduler = Scheduler(nc, core, upkeep, MAX_INFLIGHT, Intake(per_tenant=32))
        self.admitted: list[str] = []
        self.quiet_in = asyncio.Event()
        submit = core.submit

        async def recording(
            subject: str, data: bytes, handle, seq: int | None = None, stored_at: float | None = None
        ) -> None:
            await submit(subject, data, handle, seq, stored_at)
            request = InferRequest.model_validate_json(data)
            rid = request.request_id
            if (request.tenant_id, rid) in core.held:
                self.admitted.append(rid)
                if rid.startswith("quiet"):
                    self.quiet_in.set()

        core.submit = recording  # type: ignore[method-assign]


async def publish(js, rid: str, tenant: str) -> None:
    request = InferRequest(
        request_id=rid,
        tenant_id=tenant,
        model=BASE,
        base_model=BASE,
        prompt="hello",
        reply_to="_INBOX.x",
        sampling={"max_tokens": 4},
    )
    # as the gateway submits (a direct-NATS tenant's replies must go to its own _INBOX_<t> inbox)
    subject = subjects.infer_submit(tenant, subjects.VIA_GATEWAY)
    await js.publish(subject, encode(request), headers={"Nats-Msg-Id": rid})


@pytest.mark.parametrize("flood", [100, 400])
async def test_a_quiet_tenant_is_admitted_behind_a_bounded_part_of_any_flood(own_nats, redis_url, flood) -> None:
    nc = await nats.connect(own_nats.url)
    redis = connect_redis(redis_url)
    refusals: dict[str, str] = {}
    stop = asyncio.Event()
    try:
        js = nc.jetstream()
        await ensure_streams(js, StreamLimits())
        run = Run(nc, redis, refusals)
        psub = await run.scheduler.subscribe(js)
        for i in range(flood):  # all stored before the quiet tenant's one, as a flood in flight is
            await publish(js, f"flood-{i}", "flood")
        await publish(js, "quiet-0", "quiet")
        consuming = asyncio.create_task(run.scheduler.consume(psub, stop))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.quiet_in.wait(), 30)
        stop.set()
        await consuming
        await psub.unsubscribe()
        assert "quiet-0" in run.admitted, f"not admitted behind {len(run.admitted)} of the flood"
        ahead = run.admitted.index("quiet-0")
        # the queue fills with the flood, then the quiet tenant gets in on its share: the same bound
        # for a flood of 100 as of 400, where arrival order puts all of it ahead
        assert ahead <= MAX_INFLIGHT, ahead
        assert set(refusals.values()) <= {"quota_exceeded"} and "quiet-0" not in refusals
    finally:
        await redis.aclose()
        await nc.close()


async def test_the_consumer_holds_a_flood_unacknowledged_even_when_made_before(own_nats, redis_url) -> None:
    """Past the server's default cap of 1,000 unacknowledged messages delivery would stop behind a
    flood held in the intake; the scheduler raises it on a consumer an older scheduler made."""
    nc = await nats.connect(own_nats.url)
    redis = connect_redis(redis_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, StreamLimits())
        await js.pull_subscribe(
            subjects.INFER_SUBMIT_ALL,
            durable="scheduler",
            stream=subjects.INFER_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=5),
        )
        await Run(nc, redis, {}).scheduler.subscribe(js)
        info = await js.consumer_info(subjects.INFER_STREAM, "scheduler")
        assert info.config.max_ack_pending > StreamLimits().infer_max_msgs
    finally:
        await redis.aclose()
        await nc.close()
