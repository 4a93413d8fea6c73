"""The scheduler's bus ports (``services.scheduler.ports.bus_ports``: dispatch to a worker, error
replies, worker control, resolves from the registry) against fake workers on the in-memory bus: the
worker's typed refusals, no worker, a silent worker. No server process."""

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from services.scheduler.dispatcher import Ports
from services.scheduler.ports import bus_ports
from services.scheduler.settings import SchedulerSettings
from shared import subjects
from shared.bus import decode, serve
from shared.catalog.resolve import to_resolved
from shared.catalog.view import CatalogView, ask_registry
from shared.errors import ModelNotFound, NoFreeSlot, NoResponders, QuotaExceeded, ServiceUnavailable, UpstreamTimeout
from shared.memory_bus import MemoryBus
from shared.schemas import (
    DispatchReply,
    InferRequest,
    ReplyEnvelope,
    ReplyError,
    ResolveReply,
    ResolveRequest,
    WorkerControl,
)
from tests.helpers.records import make_record

DISPATCH_TIMEOUT_S = 0.2


def infer_request(request_id: str = "req-1") -> InferRequest:
    return InferRequest(
        request_id=request_id,
        tenant_id="demo",
        model="tiny-llama",
        base_model="tiny-llama",
        prompt="Hello",
        reply_to="_INBOX.gateway.1",
    )


@pytest.fixture
async def wired() -> AsyncIterator[tuple[MemoryBus, Ports]]:
    bus = MemoryBus(seed=0)
    nc = bus.connect("scheduler")
    view = CatalogView(ask_registry(nc, DISPATCH_TIMEOUT_S))  # unloaded: every resolve is asked of the registry
    settings = SchedulerSettings(dispatch_timeout_s=DISPATCH_TIMEOUT_S)
    yield bus, bus_ports(nc, None, settings, view)  # type: ignore[arg-type]
    await nc.close()
    assert bus.errors == []


async def test_dispatch_gets_the_workers_answer_or_its_typed_refusal(wired: tuple[MemoryBus, Ports]) -> None:
    bus, ports = wired
    taken: list[str] = []

    async def accept(req: InferRequest) -> DispatchReply:
        if req.request_id == "full":
            raise NoFreeSlot("every rank-8 slot is taken")
        taken.append(req.request_id)
        return DispatchReply(accepted=True, worker_id="w1")

    await serve(bus.connect("w1"), subjects.worker_dispatch("w1"), InferRequest, accept)
    reply = await ports.dispatch("w1", infer_request(), {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    assert (reply.accepted, reply.worker_id, taken) == (True, "w1", ["req-1"])
    with pytest.raises(NoFreeSlot, match="rank-8"):  # a subclass of ServiceUnavailable, kept as itself
        await ports.dispatch("w1", infer_request("full"), None)


async def test_dispatch_to_a_missing_or_silent_worker(wired: tuple[MemoryBus, Ports]) -> None:
    bus, ports = wired
    with pytest.raises(ServiceUnavailable, match=r"nothing serves lf\.worker\.gone\.dispatch"):
        await ports.dispatch("gone", infer_request(), None)
    asked: list[Msg] = []

    async def hang(msg: Msg) -> None:
        asked.append(msg)

    await bus.connect("w2").subscribe(subjects.worker_dispatch("w2"), cb=hang)
    # connected all along, no reconnect meanwhile: the timeout says the worker is stuck, so it is raised
    with pytest.raises(UpstreamTimeout):
        await ports.dispatch("w2", infer_request(), None)
    assert len(asked) == 1


async def test_error_replies_and_controls_reach_their_subjects(wired: tuple[MemoryBus, Ports]) -> None:
    bus, ports = wired
    listener = bus.connect("gateway")
    inbox = await listener.subscribe("_INBOX.gateway.1")
    controls = await listener.subscribe(f"{subjects.PREFIX}.worker.*.control")
    await ports.reply_error("_INBOX.gateway.1", "req-1", QuotaExceeded("tenant demo is over its quota"))
    await ports.control("w3", WorkerControl(action="cancel", request_id="req-1", tenant_id="demo"))
    body = decode(ReplyEnvelope, (await inbox.next_msg()).data).body
    assert isinstance(body, ReplyError) and (body.request_id, body.error.code) == ("req-1", "quota_exceeded")
    msg = await controls.next_msg()
    assert msg.subject == subjects.worker_control("w3")
    assert decode(WorkerControl, msg.data) == WorkerControl(action="cancel", request_id="req-1", tenant_id="demo")


async def test_a_resolve_the_mirror_cannot_answer_comes_from_the_registry(wired: tuple[MemoryBus, Ports]) -> None:
    bus, ports = wired
    record = make_record("sea", 2, "demo")

    async def resolve(req: ResolveRequest) -> ResolveReply:
        if (req.tenant_id, req.model) != ("demo", "sea"):
            raise ModelNotFound(f"no {req.model} for {req.tenant_id}")
        return ResolveReply(base_model="tiny-llama", adapter=to_resolved(record))

    await serve(bus.connect("registry"), subjects.registry("resolve"), ResolveRequest, resolve)
    asked = ResolveRequest(tenant_id="demo", model="sea", request_key="k")
    assert (await ports.catalog.resolve(asked, False)).adapter == to_resolved(record)
    with pytest.raises(ModelNotFound, match="no sea for other"):
        await ports.catalog.resolve(asked.model_copy(update={"tenant_id": "other"}), True)


async def test_a_worker_not_yet_resubscribed_after_a_reconnect_is_asked_again_not_judged_absent() -> None:
    """The first wait overlaps a reconnect (the worker may hold the request), and the next ask finds
    the worker's dispatch subscription not back yet. Before: that NoResponders was a plain 503 and
    the request went to another worker while this one could still run it."""
    bus = MemoryBus(seed=0)
    nc = bus.connect("scheduler")
    view = CatalogView(ask_registry(nc, DISPATCH_TIMEOUT_S))
    ports = bus_ports(nc, None, SchedulerSettings(dispatch_timeout_s=DISPATCH_TIMEOUT_S), view)  # type: ignore[arg-type]
    worker = bus.connect("w1")
    resubscribed = asyncio.Event()

    async def accept(req: InferRequest) -> DispatchReply:
        return DispatchReply(accepted=True, worker_id="w1")

    async def reconnect_then_serve(msg: Msg) -> None:
        await first.unsubscribe()  # the reply is lost and the worker's subscription goes with its connection
        nc.stats["reconnects"] += 1  # the scheduler's connection came back meanwhile
        await asyncio.sleep(DISPATCH_TIMEOUT_S * 2)  # asks in between find nobody subscribed
        await serve(worker, subjects.worker_dispatch("w1"), InferRequest, accept)
        resubscribed.set()

    first = await worker.subscribe(subjects.worker_dispatch("w1"), cb=reconnect_then_serve)
    request = infer_request().model_copy(update={"accept_deadline": time.time() + 30})
    reply = await ports.dispatch("w1", request, None)
    assert reply.accepted and resubscribed.is_set()
    with pytest.raises(NoResponders):  # with no reconnect in between, nobody subscribed is answered at once
        await ports.dispatch("gone", request, None)
    await nc.close()
