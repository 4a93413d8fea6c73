"""Open the ``lf_tenants`` KV bucket and build the Tenants ops from its contents."""

from nats.js import JetStreamContext

from services.registry.kv import load_all, open_bucket
from services.registry.tenants import Tenants
from shared import subjects


async def open_tenants(js: JetStreamContext) -> Tenants:
    bucket = await open_bucket(js, subjects.REGISTRY_TENANTS_BUCKET)

    async def put(key: str, value: bytes) -> None:
        await bucket.put(key, value)

    return Tenants(await load_all(bucket), put)
