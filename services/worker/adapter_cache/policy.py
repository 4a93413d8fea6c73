"""Pluggable eviction policies: which evictable adapter of a tier leaves first.

A policy only ranks candidates. The tiers decide who is a candidate (pins and adapters with
requests in flight never are) and enforce tenant quotas; the policy sees every access through
``touch`` and, for the heat policy, the fleet heat through ``update_heat``.
"""

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.worker.adapter_cache.cache_config import CacheConfig, PolicyName
from shared.decay import DecayedRate
from shared.schemas import SloClass

Slo = SloClass


@dataclass(frozen=True, slots=True)
class Entry:
    """What a tier knows of a cached adapter besides its weights."""

    key: str  # adapter_id@version
    rank: int
    tenant: str | None = None
    slo: Slo = "interactive"
    slot_limit: int | None = None  # the tenant's quota from its limits; tighter than the config share wins
    hard: bool = False  # at its quota the tenant waits for its own slots instead of evicting others'
    digest: str | None = None  # its weights' (Cached.digest), once fetched


class EvictionPolicy(ABC):
    """Ranks entries by how much keeping them is worth; ties go to the least recently used. Not thread-safe."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # key -> last access time

    def touch(self, key: str, now: float) -> None:
        """One request for ``key`` at ``now`` (hit or miss)."""
        self._last[key] = now

    def forget(self, key: str) -> None:
        """Drop every trace of ``key`` (its version was invalidated)."""
        self._last.pop(key, None)

    def update_heat(self, heat: Mapping[str, float]) -> None:  # noqa: B027  # a no-op default, not abstract
        """Fleet-wide decayed request rates (adapter key -> requests/s); ignored by policies without heat."""

    @abstractmethod
    def score(self, entry: Entry, now: float) -> float:
        """Worth of keeping ``entry``: the lowest score is evicted first."""

    def victim(self, candidates: Iterable[Entry], now: float) -> Entry | None:
        """The candidate to evict, or None when there is none."""
        last = self._last
        return min(candidates, key=lambda e: (self.score(e, now), last.get(e.key, 0.0)), default=None)


class LruPolicy(EvictionPolicy):
    def score(self, entry: Entry, now: float) -> float:
        return self._last.get(entry.key, 0.0)


class LfuPolicy(EvictionPolicy):
    """Request count over the whole history (kept for evicted keys too), ties by recency."""

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[str, int] = {}

    def touch(self, key: str, now: float) -> None:
        super().touch(key, now)
        self._counts[key] = self._counts.get(key, 0) + 1

    def forget(self, key: str) -> None:
        super().forget(key)
        self._counts.pop(key, None)

    def score(self, entry: Entry, now: float) -> float:
        return self._counts.get(entry.key, 0)


class HeatPolicy(EvictionPolicy):
    """Decayed request rate, local (LRFU-like: recency and frequency in one number) plus the fleet heat.

    score = slo_weight * (local_rate + heat_weight * fleet_rate), slo_weight = batch_weight for batch
    adapters, standard_weight for standard ones, 1 for interactive. The local rate remembers evicted adapters until it decays away, so a
    returning hot adapter is not the next victim the way it is under LRU.
    """

    def __init__(
        self, half_life_s: float, heat_weight: float = 1.0, batch_weight: float = 0.5, standard_weight: float = 0.75
    ):
        super().__init__()
        self.local = DecayedRate(half_life_s)
        self.heat_weight = heat_weight
        self.batch_weight = batch_weight
        self._slo_weight = {"interactive": 1.0, "standard": standard_weight, "batch": batch_weight}
        self._fleet: dict[str, float] = {}

    def touch(self, key: str, now: float) -> None:
        super().touch(key, now)
        self.local.bump(key, now)

    def forget(self, key: str) -> None:
        super().forget(key)
        self.local.forget(key)
        self._fleet.pop(key, None)

    def update_heat(self, heat: Mapping[str, float]) -> None:
        self._fleet = dict(heat)

    def score(self, entry: Entry, now: float) -> float:
        rate = self.local.rate(entry.key, now) + self.heat_weight * self._fleet.get(entry.key, 0.0)
        return rate * self._slo_weight[entry.slo]


def make_policy(name: PolicyName, config: CacheConfig, half_life_s: float | None = None) -> EvictionPolicy:
    """The named policy; the heat policy decays with ``half_life_s`` (default: the GPU tier's)."""
    if name == "lru":
        return LruPolicy()
    if name == "lfu":
        return LfuPolicy()
    return HeatPolicy(
        half_life_s or config.half_life_s, config.heat_weight, config.batch_weight, config.standard_weight
    )
