"""Admission: per-tenant requests/min and tokens/min token buckets and a concurrency cap, in Redis
(one atomic Lua script each way), or in-process while Redis is unavailable."""

import uuid
from dataclasses import dataclass
from functools import partial

from redis.asyncio import Redis

from services.scheduler import lua
from services.scheduler.limiter import LocalLimiter
from services.scheduler.redis_guard import RedisGuard
from shared import metrics
from shared.errors import QuotaExceeded
from shared.schemas import InferRequest, TenantQuota


class AlreadyDispatched(Exception):
    """The request was handed to a worker before (Redis remembers it): acknowledge, don't rerun."""


@dataclass(slots=True)
class Grant:
    """What admitting one request charged, so its end can give back what it did not use."""

    tenant: str
    request_id: str
    quota: TenantQuota
    tokens: int
    in_redis: bool


def token_cost(request: InferRequest) -> tuple[int, int]:
    """(prompt tokens estimated at 4 characters a token, max_tokens): what admission charges up front."""
    if request.prompt is not None:
        chars = len(request.prompt)
    else:  # an InferRequest carries exactly one of prompt and messages
        chars = sum(len(m.content) + 8 for m in request.messages or ())
    return max(1, chars // 4), request.sampling.max_tokens


class Admission:
    def __init__(
        self, redis: Redis, guard: RedisGuard, key_prefix: str, lease_s: float, local: LocalLimiter | None = None
    ):
        self._redis = redis
        self.guard = guard
        self._prefix = key_prefix
        self.lease_s = lease_s
        self.local = local or LocalLimiter(lease_s)
        self._admit = redis.register_script(lua.ADMIT)
        self._release = redis.register_script(lua.RELEASE)

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}quota:{tenant}:"
        return [base + "rpm", base + "tpm", base + "running"]

    async def admit(self, request: InferRequest, quota: TenantQuota, dispatched_key: str | None = None) -> Grant:
        """Charge the request against its tenant's limits, or raise ``QuotaExceeded`` with retry_after_s.

        With ``dispatched_key`` (the request's dedupe marker) the same script first checks that no
        worker took the request before, raising ``AlreadyDispatched`` if one did."""
        tenant, rid = request.tenant_id, request.request_id
        cost = sum(token_cost(request))
        args: list[int | float | str] = [
            quota.requests_per_min or 0,
            quota.tokens_per_min or 0,
            quota.max_concurrent or 0,
            cost,
            rid,
            self.lease_s,
        ]
        keys = self._keys(tenant) + ([dispatched_key] if dispatched_key else [])
        ok, answer = await self.guard.call("admission", lambda: self._admit(keys=keys, args=args))
        if not ok:
            try:
                return Grant(tenant, rid, quota, self.local.admit(tenant, rid, quota, cost), in_redis=False)
            except QuotaExceeded as e:
                metrics.ADMISSION_REJECTIONS.labels("quota").inc()
                raise e
        assert answer is not None, "the script answers a list when Redis is up"
        if int(answer[0]) == 2:
            raise AlreadyDispatched(rid)
        if int(answer[0]) != 1:
            metrics.ADMISSION_REJECTIONS.labels("quota").inc()
            raise QuotaExceeded(
                f"tenant {tenant} is over its {answer[1]} limit", retry_after_s=max(0.001, float(answer[2]))
            )
        return Grant(tenant, rid, quota, int(float(answer[1])), in_redis=True)

    async def charge(self, tenant: str, quota: TenantQuota) -> None:
        """Charge one request that runs no model against the tenant's requests per minute only (no
        tokens, no concurrency slot), or raise ``QuotaExceeded`` with retry_after_s."""
        rpm_only = TenantQuota(requests_per_min=quota.requests_per_min or 0, tokens_per_min=0, max_concurrent=0)
        rid = f"charge-{uuid.uuid4().hex}"
        args: list[int | float | str] = [rpm_only.requests_per_min or 0, 0, 0, 0, rid, self.lease_s]
        ok, answer = await self.guard.call("admission", lambda: self._admit(keys=self._keys(tenant), args=args))
        if not ok:
            self.local.admit(tenant, rid, rpm_only, 0)  # QuotaExceeded propagates
            return
        assert answer is not None, "the script answers a list when Redis is up"
        if int(answer[0]) != 1:
            metrics.ADMISSION_REJECTIONS.labels("quota").inc()
            raise QuotaExceeded(
                f"tenant {tenant} is over its {answer[1]} limit", retry_after_s=max(0.001, float(answer[2]))
            )

    async def release(self, grant: Grant | None, used_tokens: int | None) -> None:
        """End of the request: free its concurrency slot and settle its tokens: refund those charged but
        not used, charge those used beyond the charge (``used_tokens`` None = unknown, nothing settled).
        A shadow run (``grant`` None) was never charged: nothing to settle."""
        if grant is None:
            return
        delta = grant.tokens - used_tokens if used_tokens is not None else 0
        if not grant.in_redis:
            self.local.release(grant.tenant, grant.request_id, delta, grant.quota)
            return
        keys = self._keys(grant.tenant)[1:]
        args: list[int | float | str] = [
            "release",
            delta,
            grant.quota.tokens_per_min or 0,
            grant.request_id,
            self.lease_s,
        ]
        await self.guard.call("release", lambda: self._release(keys=keys, args=args))

    async def renew(self, grants: list[Grant | None]) -> None:
        """Extend the concurrency leases of requests still queued or running (a lost release then
        frees itself after ``lease_s``)."""
        for grant in grants:
            if grant is None or not grant.quota.max_concurrent:
                continue
            if not grant.in_redis:
                self.local.renew(grant.tenant, grant.request_id)
                continue
            keys = self._keys(grant.tenant)[1:]
            args: list[int | float | str] = ["renew", 0, 0, grant.request_id, self.lease_s]
            ok, _ = await self.guard.call("renew", partial(self._release, keys=keys, args=args))
            if not ok:
                return
