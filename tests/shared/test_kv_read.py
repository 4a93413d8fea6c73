"""A one-shot KV read returns exactly the bucket's live values, also for a value written a moment
before (nats-py's watcher can end its initial values before one still on the wire), and leaves no
consumer behind."""

import uuid
from collections.abc import AsyncIterator

import pytest
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from shared.bus import connect
from shared.kv_read import read_latest


@pytest.fixture
async def js(nats_url) -> AsyncIterator[JetStreamContext]:
    nc = await connect(nats_url, "kv-read-test")
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


@pytest.fixture
async def bucket(js: JetStreamContext) -> AsyncIterator[KeyValue]:
    """A fresh bucket on the session's NATS, deleted after the test."""
    name = f"read_{uuid.uuid4().hex[:8]}"
    try:
        yield await js.create_key_value(config=KeyValueConfig(bucket=name, history=5))
    finally:
        await js.delete_key_value(name)


async def test_live_values_with_their_revisions_and_nothing_deleted_or_purged(js, bucket):
    kv = bucket
    assert await read_latest(kv) == []
    await kv.put("a.1", b"old")
    latest_a1 = await kv.put("a.1", b"new")
    latest_a2 = await kv.put("a.2", b"two")
    await kv.put("b.1", b"gone")
    await kv.delete("b.1")
    await kv.put("b.2", b"purged")
    await kv.purge("b.2")
    latest_c = await kv.put("c", b"c")

    found = await read_latest(kv)
    assert [(v.key, v.value, v.revision) for v in found] == [
        ("a.1", b"new", latest_a1),
        ("a.2", b"two", latest_a2),
        ("c", b"c", latest_c),
    ]
    assert [v.key for v in await read_latest(kv, "a.*")] == ["a.1", "a.2"]
    assert await read_latest(kv, "b.*") == []
    assert await js.consumers_info(kv._stream) == []  # each read deleted its consumer


async def test_a_value_written_just_before_the_read_is_always_in_it(bucket):
    kv = bucket
    for i in range(300):
        revision = await kv.put(f"k{i % 7}", str(i).encode())
        found = {v.key: v for v in await read_latest(kv)}
        assert found[f"k{i % 7}"].value == str(i).encode(), f"read {i} missed the write before it"
        assert found[f"k{i % 7}"].revision == revision
        assert len(found) == min(i + 1, 7)
