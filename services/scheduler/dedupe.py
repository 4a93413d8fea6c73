"""At most once, per tenant: a (tenant, request id) is claimed before it is dispatched to a worker
(Redis ``SET NX`` with a TTL, and in process) with the work-queue sequence of the submission that
carried it, so a redelivery of that submission (to this scheduler or, after it died, to another)
is acknowledged, never run again, while a new submission reusing the id is told it is in use. A
claim whose dispatch no worker took is released (compare-and-delete), so the request can be placed
again; one held by a scheduler that died mid-dispatch is never released: at most once wins over
at least once, and that request's client gets its typed timeout. Tenants never share a request-id namespace: one tenant using another's
id neither sees nor shadows it.

A marker that could not reach Redis (down, or failing over to a replica) is kept and written at the
first mark that reaches it again, so that once Redis is back every scheduler sees what this one
dispatched during the outage, not only this one."""

from collections import OrderedDict

from redis.asyncio import Redis

from services.scheduler.redis_guard import RedisGuard

LOCAL_LIMIT = 100_000
Key = tuple[str, str]  # (tenant, request id)
RELEASE = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class Dispatched:
    def __init__(self, redis: Redis, guard: RedisGuard, key_prefix: str, ttl_s: float):
        self._redis = redis
        self._guard = guard
        self._prefix = f"{key_prefix}dispatched:"
        self._ttl_ms = int(ttl_s * 1000)
        self._local: OrderedDict[Key, int | None] = OrderedDict()  # -> the submission's stream sequence
        self._unsynced: OrderedDict[Key, str] = OrderedDict()  # marked while Redis was away -> its value
        self._unreleased: dict[Key, str] = {}  # released while Redis was away -> the value to delete
        self._release = redis.register_script(RELEASE)

    async def mark(self, tenant: str, request_id: str, seq: int | None) -> bool:
        """Claim the request carried by work-queue message ``seq`` for a dispatch; False if it was
        claimed before (here, or by another scheduler)."""
        if (tenant, request_id) in self._unreleased:  # this scheduler's own released claim, still in Redis
            await self._released(tenant, request_id)  # if Redis is away, so is the claim's SET NX below
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

    async def release(self, tenant: str, request_id: str, seq: int | None) -> None:
        """Forget the claim of a dispatch no worker took, so the request may be dispatched again."""
        self._local.pop((tenant, request_id), None)
        value = self._unsynced.pop((tenant, request_id), None)
        if value is None:
            self._unreleased[(tenant, request_id)] = "" if seq is None else str(seq)
            await self._released(tenant, request_id)

    async def _released(self, tenant: str, request_id: str) -> bool:
        value = self._unreleased[(tenant, request_id)]
        ok, _ = await self._guard.call(
            "dedupe_release", lambda: self._release(keys=[self.key(tenant, request_id)], args=[value])
        )
        if ok:
            del self._unreleased[(tenant, request_id)]
        return ok

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
