"""The in-process limiter admission falls back to when Redis is unavailable: the same limits, per process."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.errors import QuotaExceeded
from shared.schemas import TenantQuota


@dataclass(slots=True)
class Bucket:
    """A token bucket of ``capacity`` per minute, full when new; below zero it carries a debt."""

    tokens: float
    at: float

    def level(self, capacity: float, now: float) -> float:
        return min(capacity, self.tokens + (now - self.at) * capacity / 60.0)


@dataclass(slots=True)
class LocalLimiter:
    """Token buckets for requests/min and tokens/min plus concurrency leases, like ``admission.lua``."""

    lease_s: float
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str], Bucket] = field(default_factory=dict)
    _leases: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant -> request id -> expiry

    def admit(self, tenant: str, request_id: str, quota: TenantQuota, cost: int) -> int:
        """Charge one request and ``cost`` tokens; the tokens charged. A cost above the per-minute limit
        waits for a full bucket and is then charged in full, the excess owed as debt."""
        now = self.clock()
        rpm, tpm, conc = quota.requests_per_min, quota.tokens_per_min, quota.max_concurrent
        requests = self._level(tenant, "rpm", rpm, now)
        if rpm and requests < 1:
            raise QuotaExceeded(f"tenant {tenant} is over {rpm} requests/min", retry_after_s=(1 - requests) * 60 / rpm)
        need = min(cost, tpm) if tpm else cost
        tokens = self._level(tenant, "tpm", tpm, now)
        if tpm and tokens < need:
            raise QuotaExceeded(f"tenant {tenant} is over {tpm} tokens/min", retry_after_s=(need - tokens) * 60 / tpm)
        leases = self._leases.setdefault(tenant, {})
        for rid in [r for r, until in leases.items() if until <= now]:
            del leases[rid]
        if conc and len(leases) >= conc and request_id not in leases:
            raise QuotaExceeded(f"tenant {tenant} has {conc} requests in flight", retry_after_s=1.0)
        if conc:
            leases[request_id] = now + self.lease_s
        if rpm:
            self._buckets[(tenant, "rpm")] = Bucket(requests - 1, now)
        if tpm:
            self._buckets[(tenant, "tpm")] = Bucket(tokens - cost, now)
        return cost

    def release(self, tenant: str, request_id: str, delta: int, quota: TenantQuota) -> None:
        """Free the request's concurrency slot and settle its tokens: ``delta`` > 0 gives back unused
        ones, < 0 charges those used beyond the charge."""
        self._leases.get(tenant, {}).pop(request_id, None)
        if delta and quota.tokens_per_min:
            now = self.clock()
            level = self._level(tenant, "tpm", quota.tokens_per_min, now)
            self._buckets[(tenant, "tpm")] = Bucket(min(quota.tokens_per_min, level + delta), now)

    def renew(self, tenant: str, request_id: str) -> None:
        leases = self._leases.get(tenant, {})
        if request_id in leases:
            leases[request_id] = self.clock() + self.lease_s

    def _level(self, tenant: str, kind: str, capacity: int | None, now: float) -> float:
        if not capacity:
            return 0.0
        bucket = self._buckets.get((tenant, kind))
        return capacity if bucket is None else bucket.level(capacity, now)
