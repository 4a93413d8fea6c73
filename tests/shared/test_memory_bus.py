"""The in-memory bus behaves as core NATS does for what the services use: subject wildcards,
queue groups, request-reply, no responders, and ``shared.bus``'s typed replies and errors."""

import asyncio
import re

import nats.errors
import pytest
from nats.aio.msg import Msg
from pydantic import BaseModel

from shared.bus import ERROR_HEADER, encode, reply_error, request, serve
from shared.errors import (
    Conflict,
    InternalError,
    InvalidMessage,
    NotFound,
    ReleaseGateFailed,
    RemoteError,
    ServiceUnavailable,
    UpstreamTimeout,
)
from shared.memory_bus import MemoryBus, subject_matches
from shared.schemas import ErrorBody


class Ping(BaseModel):
    n: int


class Pong(BaseModel):
    n: int
    by: str = ""


class Wrong(BaseModel):
    n: str


class Inbox:
    """A callback that keeps what it receives."""

    def __init__(self) -> None:
        self.msgs: list[Msg] = []

    async def __call__(self, msg: Msg) -> None:
        self.msgs.append(msg)

    @property
    def subjects(self) -> list[str]:
        return [m.subject for m in self.msgs]


def inbox() -> tuple[Inbox, object]:
    box = Inbox()

    async def cb(msg: Msg) -> None:  # nats-py takes coroutine functions only
        await box(msg)

    return box, cb


@pytest.mark.parametrize(
    ("pattern", "subject", "matched"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.c", False),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("a.*.c", "a.b.c", True),
        ("*.b.*", "a.b.c", True),
        ("*", "a.b", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        (">", "a.b.c", True),
        ("a.*.>", "a.b", False),
        ("a.*.>", "a.b.c", True),
        ("lf.registry.*", "lf.registry.api_key_create", True),
    ],
)
def test_subject_matching(pattern: str, subject: str, matched: bool) -> None:
    assert subject_matches(pattern, subject) is matched


@pytest.mark.parametrize("subject", ["", "a..b", "a.>.b", "a b", "a*", "a.b>", ".a", "a."])
async def test_malformed_subscriptions_are_refused(subject: str) -> None:
    nc = MemoryBus().connect()
    with pytest.raises(nats.errors.BadSubjectError):
        await nc.subscribe(subject)


@pytest.mark.parametrize("subject", ["", "a.*", "a.>", "a..b", "a\r\nPUB x 1"])
async def test_publishing_to_a_wildcard_or_malformed_subject_is_refused(subject: str) -> None:
    nc = MemoryBus().connect()
    with pytest.raises(nats.errors.BadSubjectError):
        await nc.publish(subject, b"x")


async def test_every_matching_subscription_gets_a_copy_in_order() -> None:
    bus = MemoryBus()
    a, b = bus.connect("a"), bus.connect("b")
    exact, exact_cb = inbox()
    star, star_cb = inbox()
    tail, tail_cb = inbox()
    other, other_cb = inbox()
    await a.subscribe("lf.x.one", cb=exact_cb)
    await b.subscribe("lf.x.*", cb=star_cb)
    await b.subscribe("lf.>", cb=tail_cb)
    await a.subscribe("lf.y.*", cb=other_cb)
    for subject in ("lf.x.one", "lf.x.two", "lf.x.one.deep", "lf.y.z"):
        await a.publish(subject, subject.encode(), headers={"K": " v\r\n "})
    await bus.settle()
    assert exact.subjects == ["lf.x.one"]
    assert star.subjects == ["lf.x.one", "lf.x.two"]
    assert tail.subjects == ["lf.x.one", "lf.x.two", "lf.x.one.deep", "lf.y.z"]
    assert other.subjects == ["lf.y.z"]
    assert [m.data for m in tail.msgs] == [s.encode() for s in tail.subjects]
    assert tail.msgs[0].headers == {"K": "v"}  # as nats-py encodes them: stripped, no CR/LF


async def test_a_queue_group_delivers_each_message_to_one_member() -> None:
    bus = MemoryBus(seed=1)
    nc = bus.connect()
    first, first_cb = inbox()
    second, second_cb = inbox()
    other_group, other_group_cb = inbox()
    plain, plain_cb = inbox()
    await nc.subscribe("work.*", queue="workers", cb=first_cb)
    await bus.connect().subscribe("work.>", queue="workers", cb=second_cb)  # a group spans subjects and clients
    await nc.subscribe("work.*", queue="auditors", cb=other_group_cb)
    await nc.subscribe("work.*", cb=plain_cb)
    assert bus.interest("work.a") == 3
    for i in range(60):
        await nc.publish("work.a", str(i).encode())
    await bus.settle()
    assert len(first.msgs) + len(second.msgs) == 60
    assert first.msgs and second.msgs
    assert sorted(int(m.data) for m in first.msgs + second.msgs) == list(range(60))
    assert len(other_group.msgs) == len(plain.msgs) == 60


async def test_request_reply_and_headers() -> None:
    bus = MemoryBus()
    server, client = bus.connect("server"), bus.connect("client")

    async def echo(msg: Msg) -> None:
        assert msg.reply.startswith("_INBOX.")
        await server.publish(msg.reply, msg.data.upper(), headers={"Seen": (msg.headers or {}).get("T", "")})

    await server.subscribe("svc.echo", cb=echo)
    reply = await client.request("svc.echo", b"hi", timeout=1, headers={"T": "trace"})
    assert (reply.data, reply.headers) == (b"HI", {"Seen": "trace"})
    assert bus.subjects() == ["svc.echo"]  # the request's inbox is gone


async def test_msg_respond_answers_the_requester() -> None:
    bus = MemoryBus()
    nc = bus.connect()

    async def answer(msg: Msg) -> None:
        await msg.respond(b"pong")

    await nc.subscribe("svc.ping", cb=answer)
    assert (await nc.request("svc.ping", b"ping")).data == b"pong"


async def test_no_responders() -> None:
    bus = MemoryBus()
    nc = bus.connect()
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request("svc.nobody", b"", timeout=5)
    with pytest.raises(ServiceUnavailable, match=re.escape("nothing serves svc.nobody")):
        await request(nc, "svc.nobody", Ping(n=1), Pong, 5)
    # a plain publish with a reply gets the server's status message, as with nats-server
    sub = await nc.subscribe(nc.new_inbox())
    await nc.publish("svc.nobody", b"", reply=sub.subject)
    status = await sub.next_msg(timeout=1)
    assert (status.data, status.headers) == (b"", {"Status": "503"})


async def test_a_responder_that_never_answers_times_out() -> None:
    bus = MemoryBus()
    nc = bus.connect()
    silent, silent_cb = inbox()
    await nc.subscribe("svc.silent", cb=silent_cb)
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request("svc.silent", b"", timeout=0.05)
    with pytest.raises(UpstreamTimeout, match=re.escape("svc.silent did not answer within 0.1s")):
        await request(nc, "svc.silent", Ping(n=1), Pong, 0.05)
    assert len(silent.msgs) == 2


async def test_serve_and_request_carry_typed_replies_and_errors() -> None:
    bus = MemoryBus()
    nc = bus.connect()

    async def handler(ping: Ping) -> Pong:
        if ping.n == 1:
            raise Conflict("version 1 is taken", param="version")
        if ping.n == 2:
            raise ReleaseGateFailed("no eval recorded")
        if ping.n == 3:
            raise ValueError("a bug")
        return Pong(n=ping.n + 1, by="svc")

    await serve(nc, "svc.typed", Ping, handler)
    assert await request(nc, "svc.typed", Ping(n=41), Pong, 1) == Pong(n=42, by="svc")
    with pytest.raises(Conflict) as conflict:
        await request(nc, "svc.typed", Ping(n=1), Pong, 1)
    assert (type(conflict.value), conflict.value.message, conflict.value.param) == (
        Conflict,
        "version 1 is taken",
        "version",
    )
    with pytest.raises(ReleaseGateFailed, match="no eval recorded"):  # a subclass keeps its own type
        await request(nc, "svc.typed", Ping(n=2), Pong, 1)
    with pytest.raises(InternalError, match=re.escape("ValueError while handling svc.typed")):
        await request(nc, "svc.typed", Ping(n=3), Pong, 1)
    with pytest.raises(InvalidMessage, match="Ping: n: "):  # a wrong body never reaches the handler
        await request(nc, "svc.typed", Wrong(n="x"), Pong, 1)
    raw = await nc.request("svc.typed", b"not json", timeout=1)
    assert raw.headers == {ERROR_HEADER: "invalid_message"}
    # nothing a client sent stopped the subscription
    assert (await request(nc, "svc.typed", Ping(n=0), Pong, 1)).n == 1
    assert bus.errors == []


async def test_a_hand_made_error_reply_is_raised_as_its_type() -> None:
    bus = MemoryBus()
    nc = bus.connect()

    async def refuse(msg: Msg) -> None:
        await reply_error(nc, msg.reply, NotFound("API key 'k1' does not exist", param="key_id"))

    await nc.subscribe("svc.refuse", cb=refuse)
    with pytest.raises(NotFound) as missing:
        await request(nc, "svc.refuse", Ping(n=1), Pong, 1)
    assert (missing.value.status, missing.value.param) == (404, "key_id")


async def test_an_error_reply_of_an_unknown_code_stays_a_remote_error() -> None:
    bus = MemoryBus()
    nc = bus.connect()

    async def answer(msg: Msg) -> None:
        body = ErrorBody(code="from_a_newer_service", message="a code this process does not know", status=418)
        await nc.publish(msg.reply, encode(body), headers={ERROR_HEADER: body.code})

    await nc.subscribe("svc.newer", cb=answer)
    with pytest.raises(RemoteError) as remote:
        await request(nc, "svc.newer", Ping(n=1), Pong, 1)
    assert (remote.value.code, remote.value.status) == ("from_a_newer_service", 418)


async def test_served_queue_group_answers_once() -> None:
    bus = MemoryBus(seed=3)
    calls: list[str] = []

    def handler(name: str):
        async def handle(ping: Ping) -> Pong:
            calls.append(name)
            return Pong(n=ping.n, by=name)

        return handle

    for name in ("a1", "a2"):
        await serve(bus.connect(name), "svc.q", Ping, handler(name), queue="auditor")
    replies = [await request(bus.connect(), "svc.q", Ping(n=i), Pong, 1) for i in range(20)]
    assert len(calls) == 20 and set(calls) == {"a1", "a2"}
    assert [r.by for r in replies] == calls


async def test_a_failing_callback_is_reported_and_the_subscription_goes_on() -> None:
    bus = MemoryBus()
    nc = bus.connect()
    seen: list[bytes] = []

    async def flaky(msg: Msg) -> None:
        if msg.data == b"boom":
            raise RuntimeError("boom")
        seen.append(msg.data)

    await nc.subscribe("svc.flaky", cb=flaky)
    for data in (b"1", b"boom", b"2"):
        await nc.publish("svc.flaky", data)
    await bus.settle()
    assert seen == [b"1", b"2"]
    assert [str(e) for e in bus.errors] == ["boom"]


async def test_unsubscribe_limits_and_sync_subscriptions() -> None:
    bus = MemoryBus()
    nc = bus.connect()
    sub = await nc.subscribe("svc.sync")
    await sub.unsubscribe(limit=2)
    for data in (b"1", b"2", b"3"):
        await nc.publish("svc.sync", data)
    assert [(await sub.next_msg()).data for _ in range(2)] == [b"1", b"2"]
    assert sub.delivered == 2 and bus.subjects() == []
    with pytest.raises(nats.errors.TimeoutError):
        await sub.next_msg(timeout=0.01)
    box, cb = inbox()
    gone = await nc.subscribe("svc.gone", cb=cb)
    await gone.unsubscribe()
    await nc.publish("svc.gone", b"")
    await bus.settle()
    assert box.msgs == []
    with pytest.raises(nats.errors.BadSubscriptionError):
        await gone.unsubscribe()


async def test_a_message_over_max_payload_is_refused() -> None:
    nc = MemoryBus(max_payload=8).connect()
    await nc.publish("svc.small", b"12345678")
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.publish("svc.small", b"123456789")


async def test_drain_processes_what_is_pending_then_closes() -> None:
    bus = MemoryBus()
    nc, sender = bus.connect(), bus.connect()
    done: list[bytes] = []

    async def slow(msg: Msg) -> None:
        await asyncio.sleep(0.01)
        done.append(msg.data)

    await nc.subscribe("svc.slow", cb=slow)
    for data in (b"1", b"2", b"3"):
        await sender.publish("svc.slow", data)
    await nc.drain()
    assert done == [b"1", b"2", b"3"]
    assert nc.is_closed and bus.subjects() == []
    with pytest.raises(nats.errors.ConnectionClosedError):
        await nc.publish("svc.slow", b"")
    with pytest.raises(nats.errors.ConnectionClosedError):
        await nc.subscribe("svc.slow")
    await sender.close()
    await sender.close()  # closing twice is harmless, as in nats-py


async def test_close_wakes_a_pending_next_msg() -> None:
    nc = MemoryBus().connect()
    sub = await nc.subscribe("svc.wait")
    waiting = asyncio.create_task(sub.next_msg(timeout=5))
    await asyncio.sleep(0)
    await nc.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await waiting


async def test_no_jetstream() -> None:
    with pytest.raises(NotImplementedError, match="core NATS only"):
        MemoryBus().connect().jetstream()
