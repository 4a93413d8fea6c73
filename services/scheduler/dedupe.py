"""At most once: a request id a worker accepted is remembered (Redis ``SET NX`` with a TTL, and in
process), so a redelivered or republished submission of it is acknowledged, never run again."""

from collections import OrderedDict

from redis.asyncio import Redis

from services.scheduler.redis_guard import RedisGuard

LOCAL_LIMIT = 100_000


class Dispatched:
    def __init__(self, redis: Redis, guard: RedisGuard, key_prefix: str, ttl_s: float):
        self._redis = redis
        self._guard = guard
        self._prefix = f"{key_prefix}dispatched:"
        self._ttl_ms = int(ttl_s * 1000)
        self._local: OrderedDict[str, str] = OrderedDict()

    async def mark(self, request_id: str, worker_id: str) -> bool:
        """Record that ``worker_id`` took the request; False if it was recorded before."""
        first = request_id not in self._local
        self._local[request_id] = worker_id
        while len(self._local) > LOCAL_LIMIT:
            self._local.popitem(last=False)
        ok, set_now = await self._guard.call(
            "dedupe", lambda: self._redis.set(self._prefix + request_id, worker_id, nx=True, px=self._ttl_ms)
        )
        return bool(set_now) if ok else first

    def key(self, request_id: str) -> str:
        """The Redis marker of ``request_id``: admission's script checks it in the same round trip."""
        return self._prefix + request_id

    def seen_here(self, request_id: str) -> bool:
        """Taken by a worker through this scheduler (Redis knows of other schedulers' too)."""
        return request_id in self._local

    async def seen(self, request_id: str) -> bool:
        if request_id in self._local:
            return True
        ok, found = await self._guard.call("dedupe", lambda: self._redis.exists(self._prefix + request_id))
        return bool(found) if ok else False
