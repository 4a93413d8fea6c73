"""An in-memory NATS for unit tests of handlers, in the spirit of FastStream's TestBroker.

What it is: the core-NATS subset of nats-py's ``Client`` that ``shared.bus`` (``serve``,
``request``, ``reply_error``) and the services use, running in one event loop with no server.
``MemoryBus`` plays the server: it holds every client's subscriptions and routes each publish
with NATS semantics -- ``*`` matches one token, ``>`` one or more trailing tokens, every plain
subscription that matches gets its own copy, each queue group (by name) gets it once, on one
member picked at random, and a request nobody subscribes to is answered with the server's
"no responders" status (``Status: 503``), which ``request`` turns into nats-py's
``NoRespondersError``, as nats-py does. ``MemoryBus.connect()`` returns a client typed as
nats-py's ``Client``, so it passes wherever the services take one. Delivery is asynchronous
as over a socket: a publish queues the message, and each callback subscription runs its
callback in a task of its own, one message at a time, in order; an exception a callback
raises is kept in ``MemoryBus.errors`` (nats-py hands it to ``error_cb``). Messages are real
``nats.aio.msg.Msg`` objects, so ``msg.respond`` works.

What it is not: no JetStream, KV or object store (``jetstream()`` raises NotImplementedError),
no reconnects, auth, permissions, slow-consumer limits or flow control, no old-style
requests, no ``Subscription.messages`` iterator; a client here is not a nats-py ``Client`` and
has only the methods below (anything else is an AttributeError). It is stricter than a
default server in one place: publishing to a malformed or wildcard subject raises
``BadSubjectError`` (a server would take wildcards in a published subject as literal tokens).
"""

import asyncio
import contextlib
import inspect
import random
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal, NoReturn, cast

from nats import errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

Callback = Callable[[Msg], Awaitable[None]]
Status = Literal["connected", "draining_subs", "draining_pubs", "closed"]

INBOX_PREFIX = "_INBOX"
STATUS_HEADER = "Status"  # nats.js.api.Header.STATUS: where nats-py puts a server status line
NO_RESPONDERS_STATUS = "503"
DEFAULT_MAX_PAYLOAD = 1_048_576  # nats-server's default max_payload
DRAIN_TIMEOUT_S = 30.0  # nats-py's default drain_timeout

_WHITESPACE = re.compile(r"[ \t\r\n]")
_HEADER_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def _tokens(subject: str, *, pattern: bool) -> list[str]:
    """The subject's tokens; BadSubjectError when it is not a valid subscription ``pattern``
    (wildcards as whole tokens, ``>`` last) or, for a publish, not a literal subject."""
    if not subject or _WHITESPACE.search(subject):
        raise errors.BadSubjectError
    tokens = subject.split(".")
    for index, token in enumerate(tokens):
        if not token:
            raise errors.BadSubjectError
        if token in ("*", ">"):
            if not pattern or (token == ">" and index != len(tokens) - 1):
                raise errors.BadSubjectError
        elif pattern and ("*" in token or ">" in token):
            raise errors.BadSubjectError
    return tokens


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a message on ``subject`` reaches a subscription on ``pattern`` (NATS wildcards)."""
    return _match(_tokens(pattern, pattern=True), _tokens(subject, pattern=False))


def _match(pattern: list[str], subject: list[str]) -> bool:
    for index, token in enumerate(pattern):
        if token == ">":
            return len(subject) > index
        if index >= len(subject) or token not in ("*", subject[index]):
            return False
    return len(pattern) == len(subject)


def _wire_headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """The headers as a receiver sees them after nats-py's encoding: keys checked, values
    stripped with CR/LF made spaces, none at all when empty."""
    if not headers:
        return None
    out: dict[str, str] = {}
    for key, value in headers.items():
        name = key.strip()
        if not name:
            continue
        if not _HEADER_KEY.fullmatch(name):
            raise errors.BadHeaderError(name)
        out[name] = value.strip().replace("\r", " ").replace("\n", " ")
    return out or None


class MemorySubscription:
    """One subscription: a callback run in a task of its own, or a queue read with ``next_msg``."""

    def __init__(
        self, client: "MemoryClient", sid: int, subject: str, queue: str, cb: Callback | None, max_msgs: int
    ) -> None:
        self._client = client
        self._sid = sid
        self._subject = subject
        self._pattern = _tokens(subject, pattern=True)
        self._queue_name = queue
        self._cb = cb
        self._max_msgs = max_msgs
        self._received = 0
        self._in_flight = 0  # sent to the callback and not yet processed
        self._closed = False
        self._pending: asyncio.Queue[Msg | None] = asyncio.Queue()  # None wakes readers at the end
        self._task = asyncio.get_running_loop().create_task(self._run()) if cb is not None else None

    @property
    def subject(self) -> str:
        return self._subject

    @property
    def queue(self) -> str:
        return self._queue_name

    @property
    def delivered(self) -> int:
        return self._received

    @property
    def pending_msgs(self) -> int:
        return self._pending.qsize()

    def _matches(self, subject: list[str]) -> bool:
        return _match(self._pattern, subject)

    def _enqueue(self, subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        self._received += 1
        self._client.stats["in_msgs"] += 1
        self._client.stats["in_bytes"] += len(data)
        if self._max_msgs and self._received >= self._max_msgs:
            self._client._forget(self._sid)  # no more interest; what is pending is still processed
        headers = dict(headers) if headers else None
        msg = Msg(_client=cast(NATS, self._client), subject=subject, reply=reply, data=data, headers=headers)
        msg._sid = self._sid
        if self._cb is not None:
            self._in_flight += 1
        self._pending.put_nowait(msg)

    async def next_msg(self, timeout: float | None = 1.0) -> Msg:  # noqa: ASYNC109 (nats-py's signature)
        """The next message of a subscription made without a callback; nats-py's TimeoutError after ``timeout``."""
        if self._client.is_closed:
            raise errors.ConnectionClosedError
        if self._cb is not None:
            raise errors.Error("nats: next_msg cannot be used in async subscriptions")
        try:
            msg = await asyncio.wait_for(self._pending.get(), timeout)
        except TimeoutError:
            raise errors.TimeoutError from None
        self._pending.task_done()
        if msg is None:
            self._pending.put_nowait(None)  # for the next reader
            raise errors.ConnectionClosedError if self._client.is_closed else errors.BadSubscriptionError
        return msg

    async def unsubscribe(self, limit: int = 0) -> None:
        """Remove interest now, dropping what is pending, or after ``limit`` messages in all."""
        self._check_open()
        self._max_msgs = limit
        if limit == 0 or self._received >= limit:
            self._stop()

    async def drain(self) -> None:
        """Remove interest, then process what is pending before stopping."""
        self._check_open()
        await self._drain()

    def _check_open(self) -> None:
        if self._client.is_closed:
            raise errors.ConnectionClosedError
        if self._client.is_draining:
            raise errors.ConnectionDrainingError
        if self._closed:
            raise errors.BadSubscriptionError

    async def _drain(self) -> None:
        self._client._forget(self._sid)
        if self._cb is not None:
            await self._pending.join()
        self._stop()

    def _stop(self) -> None:
        self._closed = True
        self._client._forget(self._sid)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        self._pending.put_nowait(None)

    async def _run(self) -> None:
        assert self._cb is not None
        while True:
            msg = await self._pending.get()
            try:
                if msg is None:
                    return
                await self._cb(msg)
            except asyncio.CancelledError:
                return
            except Exception as e:  # nats-py passes a callback's exception to error_cb and goes on
                self._client.stats["errors_received"] += 1
                self._client._bus.errors.append(e)
            finally:
                self._pending.task_done()
                if msg is not None:
                    self._in_flight -= 1
            if self._max_msgs and self._received >= self._max_msgs and self._pending.empty():
                self._closed = True
                return


class MemoryClient:
    """One connection to a MemoryBus: the subset of nats-py's ``Client`` described in the module."""

    def __init__(self, bus: "MemoryBus", name: str) -> None:
        self._bus = bus
        self.name = name
        self._status: Status = "connected"
        self._subs: dict[int, MemorySubscription] = {}
        self.stats: dict[str, int] = dict.fromkeys(
            ("in_msgs", "out_msgs", "in_bytes", "out_bytes", "reconnects", "errors_received"), 0
        )

    @property
    def is_connected(self) -> bool:
        return self._status != "closed"

    @property
    def is_closed(self) -> bool:
        return self._status == "closed"

    @property
    def is_draining(self) -> bool:
        return self._status in ("draining_subs", "draining_pubs")

    @property
    def is_draining_pubs(self) -> bool:
        return self._status == "draining_pubs"

    @property
    def is_reconnecting(self) -> bool:
        return False

    @property
    def is_connecting(self) -> bool:
        return False

    @property
    def max_payload(self) -> int:
        return self._bus.max_payload

    def new_inbox(self) -> str:
        return f"{INBOX_PREFIX}.{uuid.uuid4().hex[:22]}"

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        target = _tokens(subject, pattern=False)
        if reply:
            _tokens(reply, pattern=False)
        if self.is_closed:
            raise errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise errors.ConnectionDrainingError
        if len(payload) > self._bus.max_payload:
            raise errors.MaxPayloadError
        wire = _wire_headers(headers)
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += len(payload)
        if not self._bus._route(target, subject, reply, bytes(payload), wire) and reply:
            # the server answers the requester itself, on its own subscriptions to the reply subject
            inbox = _tokens(reply, pattern=False)
            for sub in list(self._subs.values()):
                if sub._matches(inbox):
                    sub._enqueue(reply, "", b"", {STATUS_HEADER: NO_RESPONDERS_STATUS})

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callback | None = None, max_msgs: int = 0
    ) -> MemorySubscription:
        if queue and _WHITESPACE.search(queue):
            raise errors.BadSubjectError
        if self.is_closed:
            raise errors.ConnectionClosedError
        if self.is_draining:
            raise errors.ConnectionDrainingError
        if cb is not None and not inspect.iscoroutinefunction(cb):
            raise errors.Error("nats: must use coroutine for subscriptions")
        sid = self._bus._new_sid()
        sub = MemorySubscription(self, sid, subject, queue, cb, max_msgs)
        self._subs[sid] = sub
        self._bus._subs[sid] = sub
        return sub

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,  # noqa: ASYNC109 (nats-py's signature)
        headers: dict[str, str] | None = None,
    ) -> Msg:
        """Publish with a fresh inbox as reply; the first answer, nats-py's TimeoutError after ``timeout``,
        or its NoRespondersError when nothing subscribes to ``subject``."""
        _tokens(subject, pattern=False)
        if self.is_draining_pubs:
            raise errors.ConnectionDrainingError
        sub = await self.subscribe(self.new_inbox(), max_msgs=1)
        try:
            await self.publish(subject, payload, reply=sub.subject, headers=headers)
            msg = await sub.next_msg(timeout)
        finally:
            sub._stop()
        if msg.headers and msg.headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS:
            raise errors.NoRespondersError
        return msg

    async def flush(self, timeout: float = 10) -> None:  # noqa: ASYNC109 (nats-py's signature)
        """Nothing is buffered here; kept for the API (and its errors)."""
        if timeout <= 0:
            raise errors.BadTimeoutError
        if self.is_closed:
            raise errors.ConnectionClosedError

    async def drain(self) -> None:
        """Stop every subscription after what it has pending is processed, then close."""
        if self.is_draining:
            return
        if self.is_closed:
            raise errors.ConnectionClosedError
        self._status = "draining_subs"
        draining = asyncio.gather(*(sub._drain() for sub in list(self._subs.values())))
        try:
            await asyncio.wait_for(draining, DRAIN_TIMEOUT_S)
        except TimeoutError:
            self._bus.errors.append(errors.DrainTimeoutError())
        finally:
            self._status = "draining_pubs"
            await self.close()

    async def close(self) -> None:
        """Drop every subscription and what it has pending; further use raises ConnectionClosedError."""
        if self.is_closed:
            return
        self._status = "closed"
        tasks = []
        for sub in list(self._subs.values()):
            sub._stop()
            if sub._task is not None and sub._task is not asyncio.current_task():
                tasks.append(sub._task)
        self._subs.clear()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def jetstream(self, **_: object) -> NoReturn:
        raise NotImplementedError("the memory bus has core NATS only: test JetStream code against nats-server")

    def _forget(self, sid: int) -> None:
        self._subs.pop(sid, None)
        self._bus._subs.pop(sid, None)


class MemoryBus:
    """The server side: every client's subscriptions, and the routing of each publish."""

    def __init__(self, *, seed: int | None = None, max_payload: int = DEFAULT_MAX_PAYLOAD) -> None:
        self.max_payload = max_payload
        self.errors: list[Exception] = []  # what subscription callbacks raised, oldest first
        self._random = random.Random(seed)
        self._subs: dict[int, MemorySubscription] = {}
        self._last_sid = 0

    def connect(self, name: str = "memory") -> NATS:
        """A new client, typed as nats-py's so that services and ``shared.bus`` take it."""
        return cast(NATS, MemoryClient(self, name))

    def subjects(self) -> list[str]:
        """The subject of every live subscription, in the order they were made (for leak checks)."""
        return [sub.subject for sub in self._subs.values()]

    def interest(self, subject: str) -> int:
        """How many subscriptions a message on ``subject`` would reach (a queue group counts once)."""
        plain, groups = self._targets(_tokens(subject, pattern=False))
        return len(plain) + len(groups)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Return once every live callback subscription has processed what it was sent, including
        what those callbacks published in turn; TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            quiet = 0
            while quiet < 2:  # twice in a row: a callback may publish right after it finished
                await asyncio.sleep(0 if quiet else 0.001)
                quiet = 0 if any(sub._in_flight for sub in self._subs.values()) else quiet + 1

    def _new_sid(self) -> int:
        self._last_sid += 1
        return self._last_sid

    def _targets(self, subject: list[str]) -> tuple[list[MemorySubscription], dict[str, list[MemorySubscription]]]:
        plain: list[MemorySubscription] = []
        groups: dict[str, list[MemorySubscription]] = {}
        for sub in self._subs.values():
            if sub._matches(subject):
                if sub.queue:
                    groups.setdefault(sub.queue, []).append(sub)
                else:
                    plain.append(sub)
        return plain, groups

    def _route(self, tokens: list[str], subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> bool:
        """Deliver to every matching subscription and one member of each queue group; whether any matched."""
        plain, groups = self._targets(tokens)
        for sub in plain + [self._random.choice(members) for members in groups.values()]:
            sub._enqueue(subject, reply, data, headers)
        return bool(plain or groups)
