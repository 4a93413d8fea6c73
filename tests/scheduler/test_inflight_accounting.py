"""What the scheduler counts against each worker: a request holds its worker from the accept until
the end of the run on that worker, and nothing else ends it, whatever order the bus delivers in."""

import asyncio

import pytest

from shared import subjects
from shared.errors import ServiceUnavailable, UpstreamTimeout
from shared.request_ref import RequestRef
from shared.schemas import DispatchReply, InferRequest
from tests.scheduler.test_dispatcher import BASE, Msg, World, completion_audit


def held_on(world: World) -> dict[str, int]:
    return {w: v.inflight for w, v in world.core.fleet.workers.items()}


class Gate:
    """A dispatch port whose answers wait until the test opens the gate."""

    def __init__(self) -> None:
        self.open = asyncio.Event()

    async def dispatch(self, worker_id: str, request: InferRequest, headers) -> DispatchReply:
        await self.open.wait()
        return DispatchReply(accepted=True, worker_id=worker_id)


async def submitted_behind(world: World, gate: Gate, rid: str, msg: Msg | None = None) -> asyncio.Task:
    """Submit ``rid`` with its dispatch held at the gate; the task ends once it has been answered."""
    world.core.ports.dispatch = gate.dispatch
    request = InferRequest(
        request_id=rid,
        tenant_id="acme",
        model=BASE,
        base_model=BASE,
        prompt="hello",
        reply_to="_INBOX.x",
        sampling={"max_tokens": 8},
    )
    subject = subjects.infer_submit("acme", subjects.VIA_GATEWAY)
    await world.core.submit(subject, request.model_dump_json().encode(), msg or Msg())
    assert ("acme", rid) in world.core.held and world.core.tasks  # being dispatched
    return asyncio.create_task(world.settle())


async def test_a_withdrawn_runs_end_does_not_free_the_worker_that_took_the_request(world):
    world.beat("slow")
    world.beat("w2", running=1)
    world.answers["slow"] = UpstreamTimeout("no answer")  # withdrawn from slow, then taken by w2
    await world.submit("r1")
    assert world.dispatched == [("slow", "r1"), ("w2", "r1")]
    await world.core.completed(completion_audit("r1", "slow", "cancelled"))
    assert ("acme", "r1") in world.core.inflight and held_on(world) == {"slow": 0, "w2": 1}
    await world.core.completed(completion_audit("r1", "w2"))
    assert ("acme", "r1") not in world.core.inflight and held_on(world) == {"slow": 0, "w2": 0}


async def test_a_withdrawn_run_ending_before_the_dispatch_reply_does_not_end_the_request(world):
    world.beat("w1")
    gate = Gate()
    submission = await submitted_behind(world, gate, "r1")
    await world.core.completed(completion_audit("r1", "elsewhere", "cancelled"))
    gate.open.set()
    await submission
    assert ("acme", "r1") in world.core.inflight and held_on(world) == {"w1": 1}
    await world.core.completed(completion_audit("r1", "w1"))
    assert not world.core.inflight and held_on(world) == {"w1": 0} and not world.core.early


@pytest.mark.parametrize("own_first", [True, False])
async def test_the_takers_own_end_seen_before_its_dispatch_reply_ends_the_request(world, own_first):
    world.beat("w1")
    gate = Gate()
    submission = await submitted_behind(world, gate, "r1")
    ends = [completion_audit("r1", "w1"), completion_audit("r1", "elsewhere", "cancelled")]
    for event in ends if own_first else ends[::-1]:
        await world.core.completed(event)
    gate.open.set()
    await submission
    assert not world.core.inflight and held_on(world) == {"w1": 0} and not world.core.early


class AckFails(Msg):
    async def ack(self) -> None:
        raise ConnectionError("the bus is gone")


async def test_an_end_seen_before_the_dispatch_reply_frees_the_worker_even_if_the_ack_fails(world):
    world.beat("w1")
    gate = Gate()
    submission = await submitted_behind(world, gate, "r1", AckFails())
    await world.core.completed(completion_audit("r1", "w1"))
    gate.open.set()
    await submission
    assert not world.core.inflight and held_on(world) == {"w1": 0}


async def test_an_end_seen_for_a_request_dropped_before_any_accept_is_forgotten(world):
    world.beat("w1", max_running=1)
    await world.submit("busy")
    await world.submit("r1")  # queued: w1 is full
    await world.core.completed(completion_audit("r1", "elsewhere", "cancelled"))
    assert await world.core.cancel(RequestRef("acme", "r1"))
    assert not world.core.early


class Refusing(Gate):
    """A dispatch port that, once opened, answers a transient refusal (a worker that was full)."""

    calls = 0

    async def dispatch(self, worker_id: str, request: InferRequest, headers) -> DispatchReply:
        self.calls += 1
        await self.open.wait()
        return DispatchReply(accepted=False, worker_id=worker_id, error=ServiceUnavailable("full").to_body())


async def test_a_request_cancelled_while_being_dispatched_is_cancelled_on_the_worker_that_accepts_it(world):
    """The gateway's accept wait ran out while the worker had not answered the dispatch yet."""
    world.beat("w1")
    gate = Gate()
    submission = await submitted_behind(world, gate, "r1")
    assert await world.core.cancel(RequestRef("acme", "r1"))
    assert world.controls == []  # no worker has it yet
    gate.open.set()
    await submission
    assert world.controls == [("w1", "cancel", "acme", "r1")]
    await world.core.completed(completion_audit("r1", "w1", outcome="cancelled"))  # the worker's end frees it
    assert not world.core.inflight and held_on(world) == {"w1": 0}


async def test_a_request_cancelled_while_being_dispatched_is_not_queued_again_when_the_worker_refuses(world):
    world.beat("w1")
    world.beat("w2")
    gate, msg = Refusing(), Msg()
    submission = await submitted_behind(world, gate, "r1", msg)
    assert await world.core.cancel(RequestRef("acme", "r1"))
    gate.open.set()
    await submission
    assert gate.calls == 1 and msg.acts == ["term"] and world.controls == []  # not offered to w2
    assert not world.core.held and not world.core.inflight and world.core.queue.remove(RequestRef("acme", "r1")) is None
