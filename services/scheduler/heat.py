"""Per-adapter request heat in Redis; best effort, never blocking the request path."""

import json
import time

import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

HEAT_KEY = "heat"  # under the deployment's redis_key_prefix
log = structlog.get_logger("scheduler.heat")


class HeatCounter:
    def __init__(self, redis: Redis, key_prefix: str = "lf:"):
        self._redis = redis
        self._key = f"{key_prefix}{HEAT_KEY}"
        self.healthy = True
        self._last_warning = 0.0

    async def bump(self, submission: bytes) -> None:
        try:
            raw = json.loads(submission)
            adapter = raw.get("adapter") or {}
            member = f"{adapter['adapter_id']}@{adapter['version']}" if adapter else f"base:{raw['base_model']}"
        except (ValueError, KeyError, TypeError):
            return
        try:
            await self._redis.zincrby(self._key, 1.0, member)
            self.healthy = True
        except (RedisError, OSError) as e:
            self.healthy = False
            if time.monotonic() - self._last_warning > 10:
                self._last_warning = time.monotonic()
                log.warning("redis_unavailable", error=str(e))

    async def close(self) -> None:
        await self._redis.aclose()
