"""A one-shot KV read returns exactly the bucket's live values, also for a value written a moment
before (nats-py's watcher can end its initial values before one still on the wire), and leaves no
consumer behind."""

import uuid

from nats.js.api import KeyValueConfig

from shared.bus import connect
from shared.kv_read import read_latest


async def test_live_values_with_their_revisions_and_nothing_deleted_or_purged(nats_url):
    nc = await connect(nats_url, "kv-read-test")
    js = nc.jetstream()
    name = f"read_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name, history=5))
    try:
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
        assert await js.consumers_info(f"KV_{name}") == []  # each read deleted its consumer
    finally:
        await js.delete_key_value(name)
        await nc.close()


async def test_a_value_written_just_before_the_read_is_always_in_it(nats_url):
    nc = await connect(nats_url, "kv-read-race")
    js = nc.jetstream()
    name = f"race_{uuid.uuid4().hex[:8]}"
    kv = await js.create_key_value(config=KeyValueConfig(bucket=name, history=1))
    try:
        for i in range(300):
            revision = await kv.put(f"k{i % 7}", str(i).encode())
            found = {v.key: v for v in await read_latest(kv)}
            assert found[f"k{i % 7}"].value == str(i).encode(), f"read {i} missed the write before it"
            assert found[f"k{i % 7}"].revision == revision
            assert len(found) == min(i + 1, 7)
    finally:
        await js.delete_key_value(name)
        await nc.close()
