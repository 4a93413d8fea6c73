"""Keep an in-memory mirror equal to a JetStream KV bucket: load it, then apply every change.

The watch's consumer lives on the server (nats-py does not re-create it if the server loses it,
as across a nats-server restart), so the watch starts over after every reconnect (woken by it on a
client ``shared.bus.connect`` made, rather than looking for it every 0.25 s), and is checked
against the bucket itself: when no entry has come for ``check_s``, the bucket's last revision is
read; if an entry the bucket held at the previous check has still not arrived, the watch has
stalled and is started over. A mirror lags its bucket by at most about two check periods.

A mirror counts as loaded once it has applied the bucket's last revision as of the watch's start
(the watch delivers in revision order), or, should that entry be gone meanwhile, once the watch's
consumer has nothing left to deliver and every revision it delivered is applied. nats-py's own
"initial values done" marker is not enough: it can come before entries already on their way
(nats-io/nats.py#842), and a partial mirror called loaded answers 401 for a key its bucket holds.
"""

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

from shared import metrics
from shared.event_loop import keep_cancel
from shared.reconnects import reconnects
from shared.undecodable import skip

log = structlog.get_logger("kv_follow")
RETRY_S = 0.5
CHECK_S = 5.0
POLL_S = 0.25  # how often a quiet watch looks for a reconnect (of a client not made by shared.bus.connect)

# (key, value or None for a delete/purge, revision = the entry's stream sequence)
Apply = Callable[[str, bytes | None, int], None]
CATCH_UP_S = 5.0


class Position:
    """How far a mirror has applied its bucket: the newest revision (stream sequence) applied. Its
    ``caught_up`` is a read barrier: the mirror holds every write the bucket had acknowledged when
    it was called, whichever process made it (another replica's create, then this one's read)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.revision = 0
        self._moved = asyncio.Event()

    def tracking(self, apply: Apply) -> Apply:
        """``apply``, recording each entry's revision once it is applied."""

        def applied(key: str, value: bytes | None, revision: int) -> None:
            try:
                apply(key, value, revision)
            finally:  # a bad entry is skipped (logged by the follower), not waited for
                if revision > self.revision:
                    self.revision = revision
                    self._moved.set()

        return applied

    async def caught_up(self, bucket: KeyValue, timeout_s: float = CATCH_UP_S) -> None:
        """Return once the mirror has applied the bucket's last revision as of now; ``StaleMirror``
        if the watch does not bring it within ``timeout_s`` (it is restarted by then if stalled)."""
        await self.reached((await bucket.status()).stream_info.state.last_seq, timeout_s)

    async def reached(self, target: int, timeout_s: float = CATCH_UP_S) -> None:
        """Return once the mirror has applied revision ``target``; ``StaleMirror`` past ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.revision < target:
            self._moved.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise StaleMirror(f"the {self.name} mirror is at revision {self.revision}, the bucket at {target}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), left)


class StaleMirror(Exception):
    """A mirror did not catch up with its bucket within the barrier's bound."""


class StaleWatch(Exception):
    """The bucket holds an entry the watch has not delivered within a check period, or the
    connection was re-established under the watch."""


async def _bucket(js: JetStreamContext, name: str) -> KeyValue:
    """The bucket, waiting for its owner (the registry) to create it on first start."""
    while True:
        try:
            return await js.key_value(name)
        except BucketNotFoundError:
            await asyncio.sleep(RETRY_S)


async def _consume(
    nc: NATS, bucket: KeyValue, name: str, apply: Apply, loaded: Callable[[], None], check_s: float
) -> None:
    with reconnects(nc) as reconnected:
        await _watch(nc, bucket, name, apply, loaded, check_s, reconnected)


async def _watch(
    nc: NATS,
    bucket: KeyValue,
    name: str,
    apply: Apply,
    loaded: Callable[[], None],
    check_s: float,
    reconnected: asyncio.Event | None,
) -> None:
    reconnects_seen = nc.stats["reconnects"]
    start = (await bucket.status()).stream_info.state.last_seq  # the initial values end at this revision
    watcher = await bucket.watchall()
    seen, expected = 0, 0  # the newest revision applied; the bucket's last revision at the previous check
    marked, is_loaded = False, False  # nats-py's marker has come (maybe early); ``loaded`` was called
    loop = asyncio.get_running_loop()
    next_check = loop.time() + check_s
    pending: asyncio.Future[Any] | None = None  # the watch's next entry (KeyValue.Entry, or None once loaded)
    # a reconnect wakes the watch (a client ``connect`` made); another client's is polled for
    woken: asyncio.Future[Any] | None = None if reconnected is None else asyncio.ensure_future(reconnected.wait())
    done: set[asyncio.Future[Any]] = set()
    try:
        while True:
            if not is_loaded and (seen >= start or (marked and not done and await _delivered_all(watcher, seen))):
                is_loaded = True
                loaded()
                log.info("kv_mirror_loaded", bucket=name)
            # nats-py leaves KeyWatcher unannotated; __anext__ yields an Entry, or None once loaded
            pending = pending or asyncio.ensure_future(watcher.__anext__())  # type: ignore[no-untyped-call]
            if woken is None:
                done, _ = await asyncio.wait({pending}, timeout=min(POLL_S, check_s))
            else:
                left = max(0.0, next_check - loop.time())
                done, _ = await asyncio.wait({pending, woken}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if nc.is_closed:
                return
            if nc.stats["reconnects"] != reconnects_seen or woken in done:
                raise StaleWatch(f"reconnected under the watch of {name}")
            if pending in done:
                entry, pending = pending.result(), None  # StopAsyncIteration: the watcher ended
                next_check = loop.time() + check_s
                if entry is None:
                    marked = True
                else:
                    seen = max(seen, entry.revision or 0)
                    try:
                        value = None if entry.operation in ("DEL", "PURGE") else entry.value
                        apply(entry.key, value, entry.revision or 0)
                    except ValidationError as e:  # one bad entry must not stop the mirror
                        skip(name, entry.key, e)
            elif loop.time() >= next_check:
                if seen < expected:
                    raise StaleWatch(f"revision {expected} of {name} not delivered within {check_s:g}s")
                expected = (await bucket.status()).stream_info.state.last_seq
                next_check = loop.time() + check_s
    finally:
        for task in (pending, woken):
            if task is not None:
                task.cancel()
        await _stop(nc, watcher, name)


async def _stop(nc: NATS, watcher: KeyValue.KeyWatcher, name: str) -> None:
    """Unsubscribe the watch; a failure is logged, never raised, so that it cannot take the place of
    the exception (or the cancel) that is ending the watch. A closed client's subscriptions are gone."""
    if nc.is_closed:
        return
    try:
        await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py leaves KeyWatcher unannotated
    except Exception as e:
        log.info("kv_watch_stop_failed", bucket=name, error=f"{type(e).__name__}: {e}")


async def follow_bucket(
    nc: NATS, name: str, apply: Apply, loaded: Callable[[], None], check_s: float = CHECK_S
) -> None:
    """Apply every entry of the bucket, call ``loaded`` once the initial values are in, then apply
    every later change; runs until cancelled. A failed or stalled watch starts over from the
    first entry, so ``apply`` must be idempotent. It returns once ``nc`` is closed (a closed client
    never reconnects)."""
    while not nc.is_closed:
        try:
            await _consume(nc, await _bucket(nc.jetstream(), name), name, apply, loaded, check_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            keep_cancel(e)
            if nc.is_closed:
                break
            metrics.KV_WATCH_RESTARTS.labels(name).inc()
            log.warning("kv_watch_restarted", bucket=name, error=f"{type(e).__name__}: {e}")
            await asyncio.sleep(RETRY_S)
    log.info("kv_mirror_stopped", bucket=name, reason="its NATS client is closed")


async def _delivered_all(watcher: KeyValue.KeyWatcher, seen: int) -> bool:
    """Whether the watch's consumer has nothing left to deliver and ``seen`` covers what it did."""
    # nats-py keeps the watch's subscription private; its consumer's state is the only exact answer
    info = await watcher._sub.consumer_info()
    if info.num_pending or info.delivered is None:
        return not info.num_pending
    # a consumer that delivered nothing reports where it started as its delivered revision
    return not info.delivered.consumer_seq or seen >= (info.delivered.stream_seq or 0)
