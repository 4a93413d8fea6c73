"""Keep an in-memory mirror equal to a JetStream KV bucket: load it, then apply every change."""

import asyncio
from collections.abc import Callable

import structlog
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError
from nats.js.kv import KeyValue
from pydantic import ValidationError

log = structlog.get_logger("kv_follow")
RETRY_S = 0.5

# (key, value or None for a delete/purge, revision = the entry's stream sequence)
Apply = Callable[[str, bytes | None, int], None]


async def _bucket(js: JetStreamContext, name: str) -> KeyValue:
    """The bucket, waiting for its owner (the registry) to create it on first start."""
    while True:
        try:
            return await js.key_value(name)
        except BucketNotFoundError:
            await asyncio.sleep(RETRY_S)


async def follow_bucket(js: JetStreamContext, name: str, apply: Apply, loaded: Callable[[], None]) -> None:
    """Apply every entry of the bucket, call ``loaded`` once the initial values are in, then apply
    every later change; runs until cancelled. A failed watch (e.g. across a reconnect) starts
    over from the first entry, so ``apply`` must be idempotent."""
    while True:
        try:
            watcher = await (await _bucket(js, name)).watchall()
            try:
                async for entry in watcher:
                    if entry is None:
                        loaded()
                        log.info("kv_mirror_loaded", bucket=name)
                        continue
                    try:
                        apply(entry.key, None if entry.operation in ("DEL", "PURGE") else entry.value,
                              entry.revision or 0)
                    except ValidationError as e:  # one bad entry must not stop the mirror
                        log.warning("bad_kv_entry", bucket=name, key=entry.key, error=str(e))
            finally:
                await watcher.stop()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("kv_watch_failed", bucket=name, error=str(e))
            await asyncio.sleep(RETRY_S)
