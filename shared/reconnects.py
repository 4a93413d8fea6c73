"""Reconnect (and close) events of the NATS clients ``shared.bus.connect`` makes: a watcher waits on
one rather than polling the client's counters, and learns of a close at once (``shared.kv_follow``)."""

import asyncio
import contextlib
import weakref
from collections.abc import Iterator

from nats.aio.client import Client as NATS

_SIGNALS: "weakref.WeakKeyDictionary[NATS, set[asyncio.Event]]" = weakref.WeakKeyDictionary()


def record(nc: NATS, signals: set[asyncio.Event]) -> None:
    """``signals``: the events ``nc``'s reconnect and close callbacks set (``fire``)."""
    _SIGNALS[nc] = signals


def fire(signals: set[asyncio.Event]) -> None:
    for event in signals:
        event.set()


@contextlib.contextmanager
def reconnects(nc: NATS) -> Iterator[asyncio.Event | None]:
    """An event set at each reconnect of ``nc`` and when it closes, for as long as the block runs
    (the waiter tells the two apart by ``nc.is_closed``); None for a client
    ``shared.bus.connect`` did not make."""
    signals = _SIGNALS.get(nc)
    if signals is None:
        yield None
        return
    event = asyncio.Event()
    signals.add(event)
    try:
        yield event
    finally:
        signals.discard(event)
