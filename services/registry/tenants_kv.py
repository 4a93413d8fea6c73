"""Open the ``lf_tenants`` KV bucket and build the Tenants ops from its contents."""

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from shared import subjects

from services.registry.tenants import Tenants


async def open_tenants_bucket(js: JetStreamContext) -> KeyValue:
    return await js.create_key_value(
        config=KeyValueConfig(bucket=subjects.REGISTRY_TENANTS_BUCKET, history=5, storage=StorageType.FILE)
    )


async def load_entries(bucket: KeyValue) -> dict[str, bytes]:
    """Every live key's value, read by one watcher."""
    entries: dict[str, bytes] = {}
    watcher = await bucket.watchall(ignore_deletes=True)
    try:
        async for entry in watcher:
            if entry is None:
                break
            entries[entry.key] = entry.value or b""
    finally:
        await watcher.stop()
    return entries


async def open_tenants(js: JetStreamContext) -> Tenants:
    bucket = await open_tenants_bucket(js)

    async def put(key: str, value: bytes) -> None:
        await bucket.put(key, value)

    return Tenants(await load_entries(bucket), put)
