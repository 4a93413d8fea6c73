"""A KV mirror follows its bucket, and starts its watch over when the watch stalls (its server-side
consumer gone) instead of serving a stale copy forever."""

import asyncio
import uuid
from collections.abc import Iterator

import nats
import pytest
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from lorafleet.cli import infra
from lorafleet.cli.infra import Server, start_nats
from shared import metrics
from shared.bus import connect
from shared.kv_follow import Position, StaleMirror, follow_bucket
from shared.reconnects import reconnects


async def _until(condition, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _stop(follow: asyncio.Task, nc) -> None:
    follow.cancel()
    await asyncio.gather(follow, return_exceptions=True)
    await nc.close()


async def test_mirror_loads_follows_and_recovers_from_a_lost_consumer(nats_url):
    nc = await connect(nats_url, "kv-follow-test")
    js = nc.jetstream()
    name = f"follow_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name, history=5))
    await kv.put("a", b"1")
    mirror: dict[str, bytes | None] = {}
    state = {"loaded": 0, "revision": 0}

    def apply(key: str, value: bytes | None, revision: int) -> None:
        mirror[key] = value
        state["revision"] = max(state["revision"], revision)

    follow = asyncio.create_task(
        follow_bucket(nc, name, apply, lambda: state.update(loaded=state["loaded"] + 1), check_s=0.3)
    )
    try:
        await _until(lambda: state["loaded"] == 1 and mirror == {"a": b"1"}, 5)
        await kv.put("b", b"2")
        await kv.delete("a")
        await _until(lambda: mirror == {"a": None, "b": b"2"}, 5)

        restarts = metrics.KV_WATCH_RESTARTS.labels(name)._value.get()
        for info in await js.consumers_info(f"KV_{name}"):  # the watch's consumer disappears on the server
            await js.delete_consumer(f"KV_{name}", info.name)
        revision = await kv.put("c", b"3")
        await _until(lambda: mirror.get("c") == b"3" and state["revision"] >= revision, 10)
        # nats-py does not re-create the lost consumer (a watch would wait forever): the check restarted it
        assert metrics.KV_WATCH_RESTARTS.labels(name)._value.get() > restarts
    finally:
        await _stop(follow, nc)


async def test_a_bucket_created_later_is_waited_for(nats_url):
    nc = await connect(nats_url, "kv-follow-late")
    js = nc.jetstream()
    name = f"late_{uuid.uuid4().hex[:8]}"
    mirror: dict[str, bytes | None] = {}
    follow = asyncio.create_task(follow_bucket(nc, name, lambda k, v, r: mirror.__setitem__(k, v), lambda: None))
    try:
        await asyncio.sleep(0.3)
        kv = await js.create_key_value(config=KeyValueConfig(bucket=name))
        await kv.put("k", b"v")
        await _until(lambda: mirror == {"k": b"v"}, 5)
    finally:
        await _stop(follow, nc)


async def test_the_read_barrier_waits_for_the_mirror_to_hold_the_buckets_last_write(nats_url):
    nc = await connect(nats_url, "kv-barrier")
    js = nc.jetstream()
    name = f"barrier_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name, history=5))
    position, mirror = Position(name), {}
    apply = position.tracking(lambda key, value, revision: mirror.__setitem__(key, value))
    try:
        await position.caught_up(kv, timeout_s=0.1)  # an empty bucket: nothing to wait for
        first = await kv.put("a", b"1")
        last = await kv.put("b", b"2")
        with pytest.raises(StaleMirror, match=f"at revision 0, the bucket at {last}"):
            await position.caught_up(kv, timeout_s=0.2)
        apply("a", b"1", first)
        waiting = asyncio.create_task(position.caught_up(kv, timeout_s=5))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # "b" is not in the mirror yet
        apply("b", b"2", last)
        await asyncio.wait_for(waiting, 1)
        assert mirror == {"a": b"1", "b": b"2"}
    finally:
        await js.delete_key_value(name)
        await nc.close()


class EarlyMarker:
    """nats-py's watcher as nats-io/nats.py#842 has it under load: its "initial values done"
    marker comes first, and the entries already on their way come after it."""

    def __init__(self, watcher) -> None:
        self._watcher, self._sub, self._first = watcher, watcher._sub, True

    async def __anext__(self):
        if self._first:
            self._first = False
            return None
        await asyncio.sleep(0.1)  # long enough for the follower to see a quiet watch after the marker
        return await self._watcher.__anext__()

    async def stop(self) -> None:
        await self._watcher.stop()


async def _follow_until_loaded(nc, name: str, mirror: dict) -> dict:
    """The mirror as it was when ``follow_bucket`` called it loaded."""
    at_load: dict = {}
    loaded = asyncio.Event()

    def on_loaded() -> None:
        at_load.update(mirror)
        loaded.set()

    follow = asyncio.create_task(follow_bucket(nc, name, lambda k, v, r: mirror.__setitem__(k, v), on_loaded))
    try:
        await asyncio.wait_for(loaded.wait(), 10)
    finally:
        follow.cancel()
        await asyncio.gather(follow, return_exceptions=True)
    return at_load


async def test_an_early_initial_values_marker_does_not_load_a_partial_mirror(nats_url, monkeypatch):
    nc = await connect(nats_url, "kv-early-marker")
    js = nc.jetstream()
    name = f"early_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name, history=5))
    for i in range(20):
        await kv.put(f"k{i}", str(i).encode())
    await kv.delete("k3")
    watchall = KeyValue.watchall

    async def early(self, **kwargs):
        return EarlyMarker(await watchall(self, **kwargs))

    monkeypatch.setattr(KeyValue, "watchall", early)
    try:
        at_load = await _follow_until_loaded(nc, name, {})
        # loaded means every key the bucket held, the deleted one as deleted
        assert at_load == {f"k{i}": None if i == 3 else str(i).encode() for i in range(20)}
    finally:
        await js.delete_key_value(name)
        await nc.close()


async def test_a_mirror_whose_last_entry_expired_before_the_watch_still_loads(nats_url, monkeypatch):
    nc = await connect(nats_url, "kv-expired-last")
    js = nc.jetstream()
    name = f"expired_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name, ttl=0.5))
    await kv.put("gone", b"1")
    watchall = KeyValue.watchall

    async def late(self, **kwargs):
        await asyncio.sleep(1.5)  # the bucket's last revision expires between its read and the watch
        return await watchall(self, **kwargs)

    monkeypatch.setattr(KeyValue, "watchall", late)
    try:
        assert await _follow_until_loaded(nc, name, {}) == {}
    finally:
        await js.delete_key_value(name)
        await nc.close()


@pytest.fixture
def restartable_nats(tmp_path) -> Iterator[Server]:
    server = start_nats(infra.free_port(), tmp_path / "nats")
    yield server
    server.stop()


async def test_a_reconnect_wakes_the_watch_which_starts_over(restartable_nats: Server):
    """The watch's consumer is lost with the server's memory: the reconnect itself starts the watch over
    (``check_s`` is far longer than the test, so the stall check cannot be what restarts it)."""
    nc = await connect(restartable_nats.url, "kv-reconnect")
    js = nc.jetstream()
    name = f"reconnect_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name))
    await kv.put("a", b"1")
    mirror: dict[str, bytes | None] = {}
    follow = asyncio.create_task(
        follow_bucket(nc, name, lambda k, v, r: mirror.__setitem__(k, v), lambda: None, check_s=600)
    )
    try:
        await _until(lambda: mirror == {"a": b"1"}, 5)
        restarts = metrics.KV_WATCH_RESTARTS.labels(name)._value.get()
        restartable_nats.stop()
        restartable_nats.start()
        await _until(lambda: nc.is_connected and nc.stats["reconnects"] >= 1, 15)
        await _until(lambda: metrics.KV_WATCH_RESTARTS.labels(name)._value.get() > restarts, 5)
        await nc.jetstream().key_value(name)  # the bucket came back from the server's store
        await kv.put("b", b"2")
        await _until(lambda: mirror == {"a": b"1", "b": b"2"}, 10)
    finally:
        await _stop(follow, nc)


async def test_the_reconnect_signal_is_for_clients_connect_made(nats_url):
    mine = await connect(nats_url, "kv-signal")
    other = await nats.connect(nats_url)
    try:
        with reconnects(mine) as event, reconnects(other) as none:
            assert isinstance(event, asyncio.Event) and not event.is_set()
            assert none is None
    finally:
        await mine.close()
        await other.close()


@pytest.mark.parametrize("own_client", [True, False], ids=["connect", "plain"])
async def test_a_mirror_on_a_closed_client_stops_and_its_cancel_is_not_swallowed(nats_url, own_client):
    # seen in CI: the client closed under a watch, the watch's cleanup raised ConnectionClosedError in
    # place of the cancel, and the mirror retried on the dead client until the test runner timed out
    nc = await connect(nats_url, "kv-follow-closed") if own_client else await nats.connect(nats_url)
    js = nc.jetstream()
    name = f"closed_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name))
    await kv.put("k", b"v")
    mirror: dict[str, bytes | None] = {}
    loaded = asyncio.Event()
    follow = asyncio.create_task(follow_bucket(nc, name, lambda k, v, r: mirror.__setitem__(k, v), loaded.set))
    await asyncio.wait_for(loaded.wait(), 5)
    await nc.close()
    # a closed client never reconnects: the mirror ends by itself rather than retrying forever
    await asyncio.wait_for(asyncio.shield(follow), 5)
    assert follow.done() and not follow.cancelled() and follow.exception() is None
    assert mirror == {"k": b"v"}


async def test_cancelling_a_mirror_whose_client_has_closed_cancels_it(nats_url, monkeypatch):
    nc = await connect(nats_url, "kv-follow-cancel")
    js = nc.jetstream()
    name = f"cancel_{uuid.uuid4().hex[:8]}"
    await js.create_key_value(config=KeyValueConfig(bucket=name))
    loaded = asyncio.Event()
    follow = asyncio.create_task(follow_bucket(nc, name, lambda k, v, r: None, loaded.set))
    await asyncio.wait_for(loaded.wait(), 5)
    # the cancel lands while the watch's cleanup talks to a client that is already closed
    monkeypatch.setattr(nc, "_status", nats.aio.client.Client.CLOSED)
    follow.cancel()
    await asyncio.wait_for(asyncio.gather(follow, return_exceptions=True), 5)
    assert follow.cancelled()
    monkeypatch.undo()
    await nc.close()
