"""Keep the gateway's ApiKeys mirror equal to the registry's ``lf_tenants`` KV bucket."""

from nats.aio.client import Client as NATS

from services.gateway.auth import ApiKeys
from shared import subjects
from shared.kv_follow import follow_bucket


async def follow_keys(nc: NATS, keys: ApiKeys) -> None:
    """Load the bucket, mark the mirror loaded, then apply every later change; runs until cancelled."""

    def loaded() -> None:
        keys.loaded = True

    await follow_bucket(nc, subjects.REGISTRY_TENANTS_BUCKET, lambda key, value, _: keys.apply(key, value), loaded)
