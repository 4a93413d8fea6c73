import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from services.scheduler.dispatcher import Ports
from services.scheduler.service import build
from services.scheduler.settings import SchedulerSettings
from services.scheduler.upkeep import Upkeep
from shared import subjects
from shared.errors import LorafleetError, ServiceUnavailable
from shared.redis_conn import connect_redis
from shared.request_ref import RequestRef
from shared.schemas import CompletionAudit, DispatchReply, InferRequest, TenantQuota, WorkerControl, WorkerHeartbeat

BASE = "base"


class Msg:
    headers = None

    def __init__(self) -> None:
        self.acts: list[str] = []
        self.kept_alive = 0

    async def ack(self) -> None:
        self.acts.append("ack")

    async def term(self) -> None:
        self.acts.append("term")

    async def nak(self, delay: float | None = None) -> None:
        self.acts.append("nak")

    async def in_progress(self) -> None:
        self.kept_alive += 1


def completion_audit(rid: str, worker_id: str, tenant_id: str = "acme", outcome: str = "length") -> CompletionAudit:
    """A worker's completion record of ``rid``: 2 prompt and 8 completion tokens."""
    return CompletionAudit(
        request_id=rid,
        tenant_id=tenant_id,
        base_model=BASE,
        cache_hit=True,
        ttft_ms=1,
        tpot_ms=1,
        prompt_tokens=2,
        completion_tokens=8,
        worker_id=worker_id,
        outcome=outcome,
    )


class World:
    """Fake workers and client inboxes around a real Dispatcher on a real Redis."""

    def __init__(self, settings: SchedulerSettings, redis) -> None:
        self.answers: dict[str, DispatchReply | LorafleetError] = {}
        self.dispatched: list[tuple[str, str]] = []
        self.requests: dict[str, InferRequest] = {}
        self.errors: dict[str, str] = {}

        async def dispatch(worker_id: str, request: InferRequest, headers) -> DispatchReply:
            self.dispatched.append((worker_id, request.request_id))
            self.requests[request.request_id] = request
            answer = self.answers.get(worker_id, DispatchReply(accepted=True, worker_id=worker_id))
            if isinstance(answer, LorafleetError):
                raise answer
            return answer

        async def reply_error(reply_to: str, request_id: str, err: LorafleetError) -> None:
            self.errors[request_id] = err.code

        async def record_rejection(tenant: str, request_id: str, err: LorafleetError) -> None:
            self.rejections.append((tenant, request_id, err.code))

        async def control(worker_id: str, message: WorkerControl) -> None:
            self.controls.append((worker_id, message.action, message.tenant_id, message.request_id))

        self.rejections: list[tuple[str, str, str]] = []  # (tenant, request id, code) audited
        self.controls: list[tuple[str, str, str | None, str | None]] = []  # (worker, action, tenant, request id)
        self.core, self.upkeep = build(settings, Ports(dispatch, reply_error, record_rejection, control), redis)
        self.upkeep: Upkeep

    def beat(self, worker_id: str, max_running: int = 4, running: int = 0) -> None:
        self.core.fleet.heartbeat(
            WorkerHeartbeat(
                worker_id=worker_id,
                base_model=BASE,
                ready=True,
                running=running,
                waiting=0,
                max_running=max_running,
                kv_blocks_free=10,
                kv_blocks_total=10,
                ts=time.time(),
            )
        )

    async def submit(self, rid: str, tenant: str = "acme", seq: int | None = None, **over) -> Msg:
        fields = {
            "request_id": rid,
            "tenant_id": tenant,
            "model": BASE,
            "base_model": BASE,
            "prompt": "hello",
            "reply_to": "_INBOX.x",
            "sampling": {"max_tokens": 8},
        }
        fields.update(over)
        msg = Msg()
        data = InferRequest(**fields).model_dump_json().encode()
        await self.core.submit(subjects.infer_submit(tenant, subjects.VIA_GATEWAY), data, msg, seq)
        await self.settle()
        return msg

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)
        while self.core.tasks:  # a dispatch that failed starts the next one
            await asyncio.wait(list(self.core.tasks))

    async def finish(self, rid: str, tenant: str | None = None) -> None:
        """End ``rid`` on its worker; ``tenant`` names whose, where two tenants run one id."""
        (entry,) = [
            e for ref, e in self.core.inflight.items() if ref.request_id == rid and tenant in (None, ref.tenant)
        ]
        await self.core.completed(completion_audit(rid, entry.worker_id, entry.request.tenant_id))
        await self.settle()


@pytest.fixture
async def world(redis_url):
    redis = connect_redis(redis_url)
    await redis.flushdb()
    settings = SchedulerSettings(
        capacity_headroom=0, no_worker_grace_s=0.2, liveness_timeout_s=5, redis_key_prefix=f"d{time.monotonic_ns()}:"
    )
    yield World(settings, redis)
    await redis.aclose()


async def test_accepted_request_is_acked_once_and_a_redelivery_never_runs_twice(world):
    world.beat("w1")
    msg = await world.submit("r1")
    assert msg.acts == ["ack"] and world.dispatched == [("w1", "r1")]
    again = await world.submit("r1")
    assert again.acts == ["ack"] and world.dispatched == [("w1", "r1")]


async def test_over_quota_is_answered_429_and_dropped(world):
    world.beat("w1")
    world.core.quotas.set("acme", TenantQuota(max_concurrent=1))
    await world.submit("r1")
    msg = await world.submit("r2")
    assert msg.acts == ["term"] and world.errors == {"r2": "quota_exceeded"}
    await world.finish("r1")
    assert (await world.submit("r3")).acts == ["ack"]


async def test_the_tenants_gpu_slot_quota_travels_with_its_requests(world):
    world.beat("w1")
    await world.submit("r1")
    assert world.requests["r1"].tenant_gpu_slots == SchedulerSettings().default_quota.max_gpu_adapter_slots
    world.core.quotas.set("acme", TenantQuota(max_gpu_adapter_slots=2))
    await world.submit("r2")
    assert world.requests["r2"].tenant_gpu_slots == 2
    world.core.quotas.set("acme", TenantQuota(max_gpu_adapter_slots=0))  # unlimited
    await world.submit("r3")
    assert world.requests["r3"].tenant_gpu_slots is None


async def test_a_flooding_tenant_does_not_starve_a_quiet_one(world):
    world.beat("w1", max_running=1)
    for i in range(8):
        await world.submit(f"flood{i}", tenant="flood")
    for i in range(2):
        await world.submit(f"quiet{i}", tenant="quiet")
    order = [rid for _, rid in world.dispatched]
    while len(order) < 10:
        await world.finish(order[-1])
        world.beat("w1", max_running=1)
        world.core.pump()
        await world.settle()
        order = [rid for _, rid in world.dispatched]
    assert order[:5].count("quiet0") + order[:5].count("quiet1") == 2


async def test_busy_worker_refusal_requeues_elsewhere_and_a_bad_request_is_final(world):
    world.beat("w1")
    world.beat("w2", running=1)
    world.answers["w1"] = ServiceUnavailable("queue full")
    assert (await world.submit("r1")).acts == ["ack"]
    assert world.dispatched == [("w1", "r1"), ("w2", "r1")]
    world.answers["w2"] = DispatchReply(
        accepted=False, worker_id="w2", error={"code": "context_length_exceeded", "message": "too long", "status": 400}
    )
    assert (await world.submit("r2")).acts == ["term"] and world.errors["r2"] == "context_length_exceeded"


async def test_lost_worker_fails_its_accepted_requests_and_queued_ones_go_elsewhere(world):
    world.beat("w1", max_running=1)
    await world.submit("started")
    queued = await world.submit("waiting")
    assert world.dispatched == [("w1", "started")] and queued.acts == []
    world.core.fleet.workers["w1"].seen_at -= 10
    world.beat("w2")
    await world.upkeep.tick()
    await world.settle()
    assert world.errors == {"started": "worker_lost"}
    assert ("w2", "waiting") in world.dispatched and queued.acts == ["ack"] and queued.kept_alive == 1


async def test_a_request_ending_while_its_lost_worker_is_failed_over_is_left_alone(world):
    world.beat("w1")
    await world.submit("a")
    await world.submit("b")
    world.core.fleet.workers["w1"].seen_at -= 10
    answer = world.core.ports.reply_error

    async def reply_error(reply_to: str, rid: str, err: LorafleetError) -> None:
        await answer(reply_to, rid, err)
        for other in {"a", "b"} - {rid}:
            if ("acme", other) in world.core.inflight:  # its completion lands while this error is on its way
                await world.finish(other)

    world.core.ports.reply_error = reply_error
    await world.upkeep.tick()
    assert len(world.errors) == 1 and not world.core.inflight


async def test_no_worker_is_judged_lost_while_the_scheduler_itself_is_cut_off(world):
    world.beat("w1")
    await world.submit("a")
    world.core.fleet.workers["w1"].seen_at -= 10  # silent, but only because the bus was gone
    await world.upkeep.tick(connected=False)
    await world.upkeep.tick(connected=True)
    assert world.errors == {} and ("acme", "a") in world.core.inflight and "w1" in world.core.fleet.workers
    world.core.fleet.workers["w1"].seen_at -= 10  # silent with the bus back: lost
    await world.upkeep.tick()
    assert world.errors == {"a": "worker_lost"}


async def test_cancelled_or_unplaceable_queued_requests_are_dropped_and_shutdown_hands_back_the_rest(world):
    world.beat("w1", max_running=1)
    await world.submit("busy")
    cancelled = await world.submit("c")
    assert await world.core.cancel(RequestRef("acme", "c")) and cancelled.acts == ["term"]
    kept = await world.submit("k")
    orphan = await world.submit("o", model="nobody-serves-this", base_model="nobody-serves-this")
    await asyncio.sleep(0.25)
    await world.upkeep.tick()
    assert orphan.acts == ["term"] and world.errors["o"] == "no_worker_available"
    await world.core.shutdown(1)
    assert kept.acts == ["nak"] and ("w1", "c") not in world.dispatched


async def test_a_dispatch_that_times_out_is_withdrawn_from_that_worker(world):
    from shared.errors import UpstreamTimeout

    world.beat("slow")
    world.beat("w2", running=1)
    world.answers["slow"] = UpstreamTimeout("no answer")
    msg = await world.submit("r1")
    assert ("slow", "cancel", "acme", "r1") in world.controls
    assert msg.acts == ["ack"] and world.dispatched[-1] == ("w2", "r1")


ACK = b'{"stream": "INFER", "seq": 7}'  # JetStream's answer to a publish, sent here by someone's reply subject
NOT_SUBMISSIONS = [
    ACK,
    b'{"body": {"kind": "error"}}',
    b"{",
    b"[]",
    b"",
    b'{"request_id": "r1", "reply_to": "_INBOX.x"}',
]


def dropped() -> float:
    return REGISTRY.get_sample_value("undecodable_messages_total", {"source": subjects.INFER_STREAM}) or 0.0


async def test_a_body_without_what_every_publisher_sets_is_dropped_unanswered_and_unaudited(world):
    """Before issue 47 each such body was audited as a rejection under the subject's tenant (a flood of
    redirected acknowledgements wrote 6,013 records under its victim)."""
    before = dropped()
    for body in NOT_SUBMISSIONS:
        msg = Msg()
        await world.core.submit(subjects.infer_submit("acme", subjects.VIA_GATEWAY), body, msg)
        assert msg.acts == ["term"], body
    assert (world.rejections, world.errors, world.dispatched) == ([], {}, [])
    assert dropped() - before == len(NOT_SUBMISSIONS)

    msg = Msg()  # a body with them is refused in the open: answered on its inbox and audited
    await world.core.submit(
        subjects.infer_submit("acme", subjects.VIA_GATEWAY),
        b'{"request_id": "r2", "tenant_id": "acme", "reply_to": "_INBOX.x"}',
        msg,
    )
    assert msg.acts == ["term"]
    assert (world.rejections, world.errors) == ([("acme", "r2", "invalid_message")], {"r2": "invalid_message"})
    assert dropped() - before == len(NOT_SUBMISSIONS)


async def test_a_cancel_of_a_dispatched_request_goes_to_the_worker_running_it(world):
    """A gateway that lost a request's accept notice does not know its worker: the scheduler does."""
    world.beat("w1")
    await world.submit("r1")
    assert ("acme", "r1") in world.core.inflight
    assert not await world.core.cancel(RequestRef("globex", "r1"))  # another tenant's id: nobody's run
    assert world.controls == []
    assert await world.core.cancel(RequestRef("acme", "r1"))
    assert world.controls == [("w1", "cancel", "acme", "r1")]
