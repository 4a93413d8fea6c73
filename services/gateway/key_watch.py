"""Keep the gateway's ApiKeys mirror equal to the registry's ``lf_tenants`` KV bucket."""

import asyncio

import structlog
from pydantic import ValidationError
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue

from services.gateway.auth import ApiKeys
from shared import subjects

log = structlog.get_logger("gateway.keys")
RETRY_S = 0.5


async def _bucket(js: JetStreamContext) -> KeyValue:
    """The bucket, waiting for the registry to create it on first start."""
    while True:
        try:
            return await js.key_value(subjects.REGISTRY_TENANTS_BUCKET)
        except BucketNotFoundError:
            await asyncio.sleep(RETRY_S)


async def follow_keys(js: JetStreamContext, keys: ApiKeys) -> None:
    """Load the bucket, mark the mirror loaded, then apply every later change; runs until cancelled."""
    while True:
        try:
            watcher = await (await _bucket(js)).watchall()
            try:
                async for entry in watcher:
                    if entry is None:
                        keys.loaded = True
                        log.info("api_keys_loaded")
                        continue
                    try:
                        keys.apply(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value)
                    except ValidationError as e:  # one bad record must not stop the mirror
                        log.warning("bad_api_key_record", key=entry.key, error=str(e))
            finally:
                await watcher.stop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("api_key_watch_failed", error=str(e))
            await asyncio.sleep(RETRY_S)
