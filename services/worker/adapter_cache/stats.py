"""Cache counters per tier, mirrored into the Prometheus families, and the snapshot heartbeats carry."""

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal

from shared import metrics

Tier = Literal["gpu", "cpu", "miss"]  # the tier that answered a lookup
Source = Literal["cpu", "store"]  # where a slot load's weights came from
TIERS: tuple[Tier, ...] = ("gpu", "cpu", "miss")


@dataclass(frozen=True, slots=True)
class CacheStats:
    """One consistent snapshot of the hierarchy, for heartbeats and dashboards."""

    gpu_adapters: list[str]
    cpu_adapters: list[str]
    pinned: list[str]
    pins_refused: list[str]  # pins beyond the cap of their rank class (every slot but one)
    in_flight: dict[str, int]  # adapter -> requests holding it
    loading: list[str]  # loads started, not yet resident (waiting for a slot included)
    waiting_for_slot: int
    lookups: dict[str, int]  # tier -> lookups it answered
    hit_ratio: dict[str, float]  # tier -> share of lookups
    loads: dict[str, int]  # source -> slot loads completed
    load_ms_mean: dict[str, float]  # source -> mean fetch + verify + copy time
    slot_wait_ms_mean: float  # mean time a load waited for a slot held by requests in flight
    evictions: dict[str, int]  # "tier/reason" -> count
    cpu_bytes: int
    slots: dict[int, tuple[int, int]]  # rank class -> (slots used, slots)
    slot_bytes: dict[int, int]  # rank class -> bytes of one slot


@dataclass(slots=True)
class CacheCounters:
    """Running totals; the hierarchy updates them under its lock."""

    lookups: Counter[str] = field(default_factory=Counter)
    loads: Counter[str] = field(default_factory=Counter)
    load_ms: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # source -> total ms
    evictions: Counter[str] = field(default_factory=Counter)
    slot_waits: int = 0
    slot_wait_ms: float = 0.0

    def lookup(self, tier: Tier) -> None:
        self.lookups[tier] += 1
        metrics.ADAPTER_CACHE_LOOKUPS.labels(tier).inc()
        total = sum(self.lookups.values())
        for name in TIERS:
            metrics.ADAPTER_CACHE_HIT_RATIO.labels(name).set(self.lookups[name] / total)

    def loaded(self, source: Source, ms: float) -> None:
        self.loads[source] += 1
        self.load_ms[source] += ms
        metrics.ADAPTER_LOAD_LATENCY.labels(source).observe(ms)

    def evicted(self, tier: Literal["gpu", "cpu"], reason: str) -> None:
        self.evictions[f"{tier}/{reason}"] += 1
        metrics.ADAPTER_EVICTIONS.labels(tier, reason).inc()

    def waited(self, ms: float) -> None:
        self.slot_waits += 1
        self.slot_wait_ms += ms
        metrics.ADAPTER_SLOT_WAIT.observe(ms)

    def hit_ratio(self) -> dict[str, float]:
        total = sum(self.lookups.values())
        return {tier: self.lookups[tier] / total if total else 0.0 for tier in TIERS}

    def load_ms_mean(self) -> dict[str, float]:
        return {source: self.load_ms[source] / n for source, n in self.loads.items() if n}
