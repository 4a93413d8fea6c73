"""At most once, per tenant: a (tenant, request id) a worker accepted is remembered (Redis ``SET NX``
with a TTL, and in process) with the work-queue sequence of the submission that carried it, so a
redelivery of that submission is acknowledged, never run again, while a new submission reusing
the id is told it is in use. Tenants never share a request-id namespace: one tenant using another's
id neither sees nor shadows it.

A marker that could not reach Redis (down, or failing over to a replica) is kept and written at the
first mark that reaches it again, so that once Redis is back every scheduler sees what this one
dispatched during the outage, not only this one."""

from collections import OrderedDict

from redis.asyncio import Redis

from services.scheduler.redis_guard import RedisGuard

LOCAL_LIMIT = 100_000
Key = tuple[str, str]  # (tenant, request id)


class Dispatched:
    def __init__(self, redis: Redis, guard: RedisGuard, key_prefix: str, ttl_s: float):
        self._redis = redis
        self._guard = guard
        self._prefix = f"{key_prefix}dispatched:"
        self._ttl_ms = int(ttl_s * 1000)
        self._local: OrderedDict[Key, int | None] = OrderedDict()  # -> the submission's stream sequence
        self._unsynced: OrderedDict[Key, str] = OrderedDict()  # marked while Redis was away -> its value

    async def mark(self, tenant: str, request_id: str, seq: int | None) -> bool:
        """Record that a worker took the request carried by work-queue message ``seq``; False if it
        was recorded before."""
        first = (tenant, request_id) not in self._local
        self._local[(tenant, request_id)] = seq
        while len(self._local) > LOCAL_LIMIT:
            self._local.popitem(last=False)
        value = "" if seq is None else str(seq)
        ok, set_now = await self._guard.call(
            "dedupe", lambda: self._redis.set(self.key(tenant, request_id), value, nx=True, px=self._ttl_ms)
        )
        if not ok:
            self._unsynced[(tenant, request_id)] = value
            while len(self._unsynced) > LOCAL_LIMIT:
                self._unsynced.popitem(last=False)
            return first
        if self._unsynced:
            await self._sync()
        return bool(set_now)

    async def _sync(self) -> None:
        """Write the markers kept while Redis was away (``SET NX``: one another scheduler wrote wins)."""
        pending = list(self._unsynced.items())

        async def write() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                for (tenant, request_id), value in pending:
                    pipe.set(self.key(tenant, request_id), value, nx=True, px=self._ttl_ms)
                await pipe.execute()

        ok, _ = await self._guard.call("dedupe_sync", write)
        if ok:
            for key, _value in pending:
                self._unsynced.pop(key, None)

    @property
    def unsynced(self) -> int:
        """Markers kept in process only, waiting for Redis to answer again."""
        return len(self._unsynced)

    def key(self, tenant: str, request_id: str) -> str:
        """The Redis marker of the request: admission's script checks it in the same round trip.
        A tenant id holds no ``:`` (it is a subject token), so the two parts never run together."""
        return f"{self._prefix}{tenant}:{request_id}"

    def seen_here(self, tenant: str, request_id: str) -> bool:
        """Taken by a worker through this scheduler (Redis knows of other schedulers' too)."""
        return (tenant, request_id) in self._local

    async def seen(self, tenant: str, request_id: str) -> bool:
        if (tenant, request_id) in self._local:
            return True
        ok, found = await self._guard.call("dedupe", lambda: self._redis.exists(self.key(tenant, request_id)))
        return bool(found) if ok else False

    async def same_submission(self, tenant: str, request_id: str, seq: int | None) -> bool:
        """Whether work-queue message ``seq`` is the submission a worker took under this id (a
        redelivery), rather than a new one reusing the id. Unknown either way (no sequence, a
        marker written without one, Redis away) counts as the same: never run twice."""
        if seq is None:
            return True
        if (tenant, request_id) in self._local:
            recorded = self._local[(tenant, request_id)]
        else:
            ok, value = await self._guard.call("dedupe", lambda: self._redis.get(self.key(tenant, request_id)))
            if not ok or not value:
                return True
            recorded = int(value)
        return recorded is None or recorded == seq
