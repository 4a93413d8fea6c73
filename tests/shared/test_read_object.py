"""read_object returns an object's exact bytes from a real JetStream object store, on both of its
paths (nats-py's plain get for small objects, a buffered read for large ones)."""

import os
import uuid

import nats
import pytest
from nats.js.api import ObjectStoreConfig
from nats.js.errors import NotFoundError

from shared.bus import PLAIN_GET_MAX_BYTES, read_object


@pytest.mark.parametrize("size", [0, 1000, PLAIN_GET_MAX_BYTES, PLAIN_GET_MAX_BYTES + 1, 3 * PLAIN_GET_MAX_BYTES + 17])
async def test_read_object_returns_the_exact_bytes(nats_url, size):
    nc = await nats.connect(nats_url)
    try:
        bucket = f"t{uuid.uuid4().hex[:8]}"
        store = await nc.jetstream().create_object_store(bucket, config=ObjectStoreConfig(bucket=bucket))
        data = os.urandom(size)
        await store.put("adapter/weights", data)
        assert await read_object(store, "adapter/weights") == data
        with pytest.raises(NotFoundError):
            await read_object(store, "adapter/missing")
    finally:
        await nc.close()
