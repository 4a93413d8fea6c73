"""NATS plumbing: connect with reconnect, JetStream streams, typed request-reply, shutdown signals."""

import asyncio
import contextlib
import dataclasses
import functools
import io
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import nats
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig, StreamInfo
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore
from pydantic import BaseModel, ValidationError

from shared import reconnects as reconnect_signals
from shared import subjects
from shared.config import CommonSettings, StreamLimits
from shared.errors import (
    InternalError,
    InvalidMessage,
    LorafleetError,
    NoResponders,
    UpstreamTimeout,
    from_body,
)
from shared.schemas import ErrorBody
from shared.telemetry import continued, inject, tracer

_tracer = tracer("bus")

M = TypeVar("M", bound=BaseModel)
P = ParamSpec("P")
R = TypeVar("R")
log = structlog.get_logger("bus")
SETTLE_S = 60.0  # how long idempotent JetStream setup is tried again while the API times out
SETTLE_PAUSE_S = 0.5


def settling(setup: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """For idempotent JetStream setup (create or bind a stream, bucket or object store, bring its
    config to what is wanted): call it again while the API times out, for up to ``SETTLE_S``. On a
    fresh cluster, replicated streams made for several processes starting at once (two registries)
    can take longer than one API timeout (nats-py's 5 s); each call reads what exists first, so what
    another process made meanwhile is found, not made twice."""

    @functools.wraps(setup)
    async def again(*args: P.args, **kwargs: P.kwargs) -> R:
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                return await setup(*args, **kwargs)
            except nats.errors.TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                log.warning("jetstream_setup_timed_out", setup=setup.__name__, retry_in_s=SETTLE_PAUSE_S)
                await asyncio.sleep(SETTLE_PAUSE_S)

    return again


ERROR_HEADER = "Lf-Error"
MAX_MESSAGE_BYTES = 1_048_576
PLAIN_GET_MAX_BYTES = 2 * 2**20  # objects up to this size are read with nats-py's plain get


def streams(limits: StreamLimits, replicas: int = 1) -> tuple[StreamConfig, ...]:
    """The platform's streams, bounded by ``limits``, each on ``replicas`` servers. INFER refuses a
    submission beyond its bounds (the publisher gets a typed refusal, ``shared.publish_refusals``); AUDIT
    and ADAPTER_EVENTS drop their oldest messages instead."""
    return tuple(dataclasses.replace(c, num_replicas=replicas) for c in _streams(limits))


def _streams(limits: StreamLimits) -> tuple[StreamConfig, ...]:
    return (
        StreamConfig(
            name=subjects.INFER_STREAM,
            subjects=[subjects.INFER_SUBMIT_ALL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=120.0,
            max_msg_size=MAX_MESSAGE_BYTES,
            max_age=3600.0,
            max_bytes=limits.infer_max_bytes,
            max_msgs=limits.infer_max_msgs,
            max_msgs_per_subject=limits.infer_max_msgs_per_tenant,  # one subject per tenant
            discard=DiscardPolicy.NEW,
            discard_new_per_subject=True,
        ),
        StreamConfig(
            name=subjects.ADAPTER_EVENTS_STREAM,
            subjects=[subjects.ADAPTER_EVENTS_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=30 * 86400.0,
            max_msg_size=MAX_MESSAGE_BYTES,
            max_bytes=limits.adapter_events_max_bytes,
            discard=DiscardPolicy.OLD,
        ),
        StreamConfig(
            name=subjects.AUDIT_STREAM,
            subjects=[subjects.AUDIT_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            duplicate_window=120.0,
            max_msg_size=MAX_MESSAGE_BYTES,
            max_bytes=limits.audit_max_bytes,
        ),
        # What the auditor signed stays: no message delete, no purge, no rollup, and a full stream
        # refuses new heads rather than discarding old ones (deny_* cannot be turned off again).
        StreamConfig(
            name=subjects.AUDIT_HEADS_STREAM,
            subjects=[subjects.AUDITOR_HEAD_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.NEW,
            max_bytes=1 << 30,
            max_msg_size=4096,
            deny_delete=True,
            deny_purge=True,
            allow_rollup_hdrs=False,
        ),
    )


STREAM_NAMES: tuple[str, ...] = tuple(str(s.name) for s in streams(StreamLimits()))  # every stream the platform makes


async def connect(
    url: str, name: str, credentials: tuple[str, str] | None = None, inbox_prefix: str = "_INBOX"
) -> NATS:
    """Connect, retrying forever in the background once connected; log every state change.

    ``credentials`` (user, password) default to this process's ``LF_NATS_USER`` /
    ``LF_NATS_PASSWORD[_FILE]``; none there means a server without auth. ``inbox_prefix`` is where
    this client's replies arrive (a worker's own, ``subjects.worker_inbox``). Servers' TLS
    certificates are verified against ``LF_NATS_CA_FILE`` when it is set."""
    settings = CommonSettings()
    user, password = credentials or settings.nats_credentials() or (None, None)

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", client=name, error=str(e))

    async def on_disconnect() -> None:
        log.warning("nats_disconnected", client=name)

    signals: set[asyncio.Event] = set()

    async def on_reconnect() -> None:
        log.info("nats_reconnected", client=name)
        reconnect_signals.fire(signals)

    async def on_closed() -> None:  # a watcher waiting for a reconnect learns that none will come
        reconnect_signals.fire(signals)

    nc = await nats.connect(
        servers=[u.strip() for u in url.split(",")],
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=2,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        closed_cb=on_closed,
        user=user,
        password=password,
        inbox_prefix=inbox_prefix,
        tls=settings.nats_tls(),
    )
    reconnect_signals.record(nc, signals)
    return nc


_COMPARED = (
    "num_replicas",
    "subjects",
    "retention",
    "storage",
    "discard",
    "discard_new_per_subject",
    "max_age",
    "max_msg_size",
    "max_bytes",
    "max_msgs",
    "max_msgs_per_subject",
    "duplicate_window",
    "deny_delete",
    "deny_purge",
)


def _drifted(wanted: StreamConfig, actual: StreamConfig) -> bool:
    """Whether a field set in ``wanted`` differs on the server (None, or a zero duplicate
    window, means the server's default)."""
    for k in _COMPARED:
        value = getattr(wanted, k)
        if value is None or (k == "duplicate_window" and value == 0):
            continue
        if value != getattr(actual, k):
            return True
    return False


@settling
async def ensure_streams(
    js: JetStreamContext, limits: StreamLimits | None = None, replicas: int | None = None
) -> list["Placement"]:
    """Create a missing stream, or bring a drifted one to this configuration; ``limits`` and
    ``replicas`` default to this process's ``LF_STREAMS__*`` and ``LF_JETSTREAM_REPLICAS``. Returns
    where each stream lives; a stream on fewer servers than asked for raises ``PlacementError``.

    A stream already as configured costs one ``STREAM.INFO``, so a service whose NATS user
    may not create or update streams starts fine once ``lorafleet nats setup`` made them."""
    settings = CommonSettings()
    wanted = replicas or settings.jetstream_replicas
    placed = []
    for config in streams(limits or settings.streams, wanted):
        assert config.name is not None, "every platform stream is named"
        try:
            info = await js.stream_info(config.name)
        except NotFoundError:
            info = await js.add_stream(config)
        else:
            if _drifted(config, info.config):
                info = await js.update_stream(config)
        placed.append(checked_placement(info, wanted))
    return placed


@settling
async def ensure_replicas(js: JetStreamContext, stream: str, replicas: int | None = None, check: bool = False) -> int:
    """The replica count ``stream`` (a KV bucket's or object store's) should have (``replicas``, default
    ``LF_JETSTREAM_REPLICAS``); an existing one with another count is updated to it. With ``check``
    its placement is verified and logged (``PlacementError`` if short)."""
    wanted = replicas or CommonSettings().jetstream_replicas
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return wanted  # created next, with this count
    if (info.config.num_replicas or 1) != wanted:
        info = await js.update_stream(dataclasses.replace(info.config, num_replicas=wanted))
    if check:
        checked_placement(info, wanted)
    return wanted


class PlacementError(RuntimeError):
    """A stream, KV bucket or object store lives on fewer servers than its replica count asks for."""


@dataclass(frozen=True, slots=True)
class Placement:
    stream: str
    replicas: int  # asked for
    leader: str | None  # None: a single server (no cluster)
    peers: tuple[str, ...]  # the other servers holding a copy


def checked_placement(info: StreamInfo, wanted: int) -> Placement:
    """Where the stream of ``info`` lives (``lorafleet nats setup`` reports it); ``PlacementError`` if on
    fewer servers than ``wanted``. Not logged: CLI commands that make sure of the streams write their
    own output on stdout."""
    name = str(info.config.name)
    cluster = info.cluster
    peers = tuple(sorted(p.name for p in (cluster.replicas or []) if p.name)) if cluster else ()
    placement = Placement(name, info.config.num_replicas or 1, cluster.leader if cluster else None, peers)
    holders = (1 if placement.leader else 0) + len(peers) if cluster else 1
    if placement.replicas < wanted or holders < wanted:
        raise PlacementError(
            f"{name} is on {holders} server(s) with replicas={placement.replicas}, but LF_JETSTREAM_REPLICAS is "
            f"{wanted}: run a NATS cluster of at least {wanted} nodes with JetStream on each"
        )
    return placement


FOLLOW_HEARTBEAT_S = 1.0  # an ordered consumer silent for two of these is rebuilt (after a server restart)


async def follow(js: JetStreamContext, stream: str, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> None:
    """Call ``cb`` with every message stored on ``subject`` from now on, across reconnects and server
    restarts, and with none stored before.

    An ordered consumer rebuilds itself after its last delivered message, or from the stream's first
    one when it has delivered none: starting it at the newest stored message (dropped here) gives it
    that position at once, so a rebuild never replays the stream's history."""
    history_end = (await js.stream_info(stream)).state.last_seq

    async def on_message(msg: Msg) -> None:
        if msg.metadata.sequence.stream > history_end:
            await cb(msg)

    await js.subscribe(
        subject,
        stream=stream,
        cb=on_message,
        ordered_consumer=True,
        idle_heartbeat=FOLLOW_HEARTBEAT_S,
        deliver_policy=DeliverPolicy.LAST,
    )


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode()


def decode(model: type[M], data: bytes) -> M:
    """Parse a message body, turning any validation failure into a typed InvalidMessage."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise InvalidMessage(f"{model.__name__}: message of {len(data)} bytes is too large")
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise InvalidMessage(f"{model.__name__}: {where}: {first.get('msg', 'invalid')}") from None


async def reply_error(nc: NATS, reply: str, error: LorafleetError) -> None:
    await nc.publish(reply, encode(error.to_body()), headers={ERROR_HEADER: error.code})


def serve(
    nc: NATS,
    subject: str,
    request_type: type[M],
    handler: Callable[[M], Awaitable[BaseModel]],
    *,
    queue: str = "",
    concurrent: bool = False,
) -> Awaitable[Subscription]:
    """Subscribe a typed request-reply handler. Bad input or a failing handler gets a typed
    error reply; nothing a client sends can stop the subscription. ``concurrent`` handles each
    request in a task of its own, so a slow one does not hold up the requests behind it."""

    async def on_message(msg: Msg) -> None:
        if not msg.reply:
            log.warning("request_without_reply", subject=msg.subject)
            return
        try:
            with continued(msg.headers), _tracer.start_as_current_span(f"serve {subject}"):
                result = await handler(decode(request_type, msg.data))
            await nc.publish(msg.reply, encode(result))
        except LorafleetError as e:
            log.info("request_refused", subject=msg.subject, code=e.code, error=e.message)
            await reply_error(nc, msg.reply, e)
        except Exception as e:  # a bug must still answer the caller, never hang it
            log.exception("request_failed", subject=msg.subject)
            await reply_error(nc, msg.reply, InternalError(f"{type(e).__name__} while handling {subject}"))

    running: set[asyncio.Task[None]] = set()

    async def in_task(msg: Msg) -> None:
        task = asyncio.create_task(on_message(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    return nc.subscribe(subject, queue=queue, cb=in_task if concurrent else on_message)


# ASYNC109: the bound is NATS's own request timeout, which this turns into a typed UpstreamTimeout
async def request(nc: NATS, subject: str, message: BaseModel, reply_type: type[M], timeout: float) -> M:  # noqa: ASYNC109
    """Typed request-reply: the reply model, or the remote's typed error raised here."""
    try:
        msg = await nc.request(subject, encode(message), timeout=timeout, headers=inject())
    except nats.errors.NoRespondersError:
        raise NoResponders(f"nothing serves {subject}") from None
    except nats.errors.TimeoutError:
        raise UpstreamTimeout(f"{subject} did not answer within {timeout:.1f}s") from None
    if msg.headers and ERROR_HEADER in msg.headers:
        raise from_body(decode(ErrorBody, msg.data))
    return decode(reply_type, msg.data)


async def drain_or_close(nc: NATS) -> None:
    """A stopping service's last step: drain (finish what is in flight, then close), or, while the
    connection is down and reconnecting (nothing can be flushed), close it at once."""
    if nc.is_closed:
        return
    if nc.is_connecting or nc.is_reconnecting:
        with contextlib.suppress(OSError):  # nats-py flushes the lost socket on close: nothing to flush
            await nc.close()
        return
    await nc.drain()


def shutdown_event() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, for a drain-then-close shutdown."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


async def read_object(store: ObjectStore, name: str) -> bytes:
    """One object's bytes (its digest checked by nats-py). nats-py's plain ``get`` concatenates
    the bytes chunk by chunk, quadratic in the size (~1.5 s for 16 MB); large objects are read
    into a buffer instead, which costs a thread hop per chunk, so small ones keep the plain path."""
    size = (await store.get_info(name)).size
    assert size is not None, "the server reports the size of every stored object"
    if size <= PLAIN_GET_MAX_BYTES:
        return (await store.get(name)).data or b""
    buffer = io.BytesIO()
    await store.get(name, writeinto=buffer)
    return buffer.getvalue()
