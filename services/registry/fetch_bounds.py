"""What the remote fetches in flight on this registry replica may hold: how many run at once (all
tenants together, and each tenant), and how many bytes they spool to its disk.

A fetch over a bound is refused at once with a Retry-After, never queued: a queue would hold the
caller past its own timeout. Spool bytes are charged chunk by chunk as they stream, and given back
when the fetch's spool directory is deleted. The bounds are this replica's: the spool is its disk.
"""

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from services.registry.settings import RemoteSourceSettings
from shared.errors import FetchCapacityFull, SourceFetchesBusy, SpoolFull, TenantSpoolFull


@dataclass(slots=True, eq=False)
class FetchLease:
    """One fetch's place among the bounds, from its start until its spool is deleted."""

    bounds: "FetchBounds"
    tenant_id: str
    deadline: float  # loop time by which the fetch has ended, fetched or refused
    spooled: int = 0  # bytes this fetch has written to the spool

    def spool(self, n: int, uri: str) -> None:
        """Charge ``n`` more spooled bytes, or refuse them (the caller stops and deletes its spool)."""
        self.bounds.charge(self, n, uri)


class FetchBounds:
    def __init__(self, settings: RemoteSourceSettings) -> None:
        self._settings = settings
        self._leases: list[FetchLease] = []

    @contextlib.contextmanager
    def lease(self, tenant_id: str, timeout_s: float) -> Iterator[FetchLease]:
        """A place for one fetch of ``tenant_id`` that ends within ``timeout_s``, held for the block."""
        mine = self._of(tenant_id)
        if len(mine) >= self._settings.max_tenant_fetches:
            raise SourceFetchesBusy(
                f"tenant {tenant_id} already runs {len(mine)} remote fetches, its limit "
                f"(LF_REMOTE__MAX_TENANT_FETCHES); retry once one ends",
                retry_after_s=self._retry_after(mine),
            )
        if len(self._leases) >= self._settings.max_fetches:
            raise FetchCapacityFull(
                f"the registry already runs {len(self._leases)} remote fetches, its limit "
                "(LF_REMOTE__MAX_FETCHES); retry once one ends",
                retry_after_s=self._retry_after(self._leases),
            )
        lease = FetchLease(self, tenant_id, asyncio.get_running_loop().time() + timeout_s)
        self._leases.append(lease)
        try:
            yield lease
        finally:
            self._leases.remove(lease)

    def charge(self, lease: FetchLease, n: int, uri: str) -> None:
        mine = self._of(lease.tenant_id)
        if sum(held.spooled for held in mine) + n > self._settings.tenant_spool_bytes:
            raise TenantSpoolFull(
                f"{uri}: tenant {lease.tenant_id}'s fetches in flight would spool more than its "
                f"{self._settings.tenant_spool_bytes} bytes (LF_REMOTE__TENANT_SPOOL_BYTES)",
                retry_after_s=self._retry_after([held for held in mine if held is not lease]),
            )
        if self.spooled + n > self._settings.spool_bytes:
            raise SpoolFull(
                f"{uri}: the fetches in flight would spool more than the registry's "
                f"{self._settings.spool_bytes} bytes (LF_REMOTE__SPOOL_BYTES)",
                retry_after_s=self._retry_after([held for held in self._leases if held is not lease]),
            )
        lease.spooled += n

    @property
    def spooled(self) -> int:
        return sum(held.spooled for held in self._leases)

    def _of(self, tenant_id: str) -> list[FetchLease]:
        return [held for held in self._leases if held.tenant_id == tenant_id]

    def _retry_after(self, others: list[FetchLease]) -> float:
        """Seconds until the first of ``others`` has ended at the latest (its own time limit)."""
        now = asyncio.get_running_loop().time()
        return max(1.0, min((held.deadline - now for held in others), default=1.0))
