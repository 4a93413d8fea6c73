"""Call Redis without ever stalling the scheduler on it: after a failure, skip it for a while."""

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from redis.exceptions import RedisError

from shared import metrics

T = TypeVar("T")
log = structlog.get_logger("scheduler.redis")


class RedisGuard:
    """Runs Redis calls; a failure marks Redis down for ``retry_s`` (callers use their local fallback),
    counts ``redis_fallbacks{op}`` and logs at most one warning per ``warn_every_s``."""

    def __init__(self, retry_s: float = 2.0, warn_every_s: float = 10.0):
        self.retry_s = retry_s
        self.warn_every_s = warn_every_s
        self._down_until = 0.0
        self._last_warning = -1e9

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self._down_until

    async def call(self, op: str, action: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
        """(True, result), or (False, None) when Redis is down or failed now."""
        if not self.healthy:
            metrics.REDIS_FALLBACKS.labels(op).inc()
            return False, None
        try:
            result = await action()
        except (RedisError, OSError, TimeoutError) as e:
            now = time.monotonic()
            self._down_until = now + self.retry_s
            metrics.REDIS_FALLBACKS.labels(op).inc()
            if now - self._last_warning >= self.warn_every_s:
                self._last_warning = now
                log.warning("redis_unavailable_using_local_fallback", op=op, error=str(e) or type(e).__name__)
            return False, None
        return True, result
