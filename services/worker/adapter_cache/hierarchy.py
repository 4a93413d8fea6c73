"""The adapter cache hierarchy: GPU slots <- CPU tier <- trusted store, loading beside the engine's step loop.

The worker calls ``acquire`` when it dispatches a request and ``release`` when the request ends,
however it ends. A lookup never blocks: a miss starts one load on the loader threads (concurrent
misses of one adapter share it) and the engine's ``AdapterManager.slot_of`` stays None until the copy
lands, so the request waits while the others run. An adapter with requests in flight, or pinned, is
never evicted; when every slot of a rank class is so held, loads for that class wait in FIFO order.
Pins hold at most every slot of a rank class but one, so unpinned adapters of the class still load;
a pin beyond that is refused (``pin`` answers False and ``stats().pins_refused`` lists it).
"""

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Literal

from services.worker.adapter_cache.backend import SlotBackend
from services.worker.adapter_cache.cache_config import CacheConfig
from services.worker.adapter_cache.cpu_tier import CpuTier
from services.worker.adapter_cache.policy import Entry, Slo, make_policy
from services.worker.adapter_cache.slot_loader import LoadFromStore, Resident, SlotLoader, settle
from services.worker.adapter_cache.slot_tier import SlotTier
from services.worker.adapter_cache.stats import CacheCounters, CacheStats, Tier
from shared import metrics
from shared.adapter_keys import adapter_key, adapter_of_key
from shared.errors import AdapterRevoked

EvictOutcome = Literal["done", "not_resident", "pinned", "in_flight"]


@dataclass(frozen=True, slots=True)
class Lookup:
    """What acquire found. ``ready`` resolves to the slot and the digest of the weights in it once
    resident, or raises the load's error."""

    tier: Tier
    ready: Future[Resident]

    @property
    def hit(self) -> bool:
        return self.tier == "gpu"


class CacheHierarchy:
    """Serves the engine's slots from the CPU tier and the trusted store; thread-safe.

    ``load_from_store(key)`` fetches, verifies and reads one adapter version on a loader thread
    (raising IntegrityError when it must not be served); the manager must hold nothing at start.
    """

    def __init__(self, manager: SlotBackend, load_from_store: LoadFromStore, config: CacheConfig,
                 *, clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.manager = manager
        self.config = config
        self._clock = clock
        classes = manager.stats().classes
        self._slot_bytes = {c.rank: c.slot_bytes for c in classes}
        gpu_policy = make_policy(config.policy, config)
        self._slots = SlotTier({c.rank: c.slots for c in classes}, gpu_policy, config.slot_quota)
        cpu_policy = make_policy(config.cpu_policy, config, config.cpu_half_life_s)
        self._cpu = CpuTier(config.cpu_budget_bytes, cpu_policy, config.tenant_cpu_share)
        self._refs: Counter[str] = Counter()  # key -> requests in flight
        self._pins: dict[str, int | None] = {}  # pinned key -> its rank class (None: not known yet)
        self._pins_refused: set[str] = set()
        self._draining: set[str] = set()  # invalidated with requests in flight: unloaded on the last release
        self._counters = CacheCounters()
        self._lock = threading.Lock()
        self._loader = SlotLoader(manager, load_from_store, self._slots, self._cpu, self._counters, self._lock,
                                  clock, self._protected, config.load_threads)  # fmt: skip

    def start(self) -> None:
        """Prefetch the configured warmup list."""
        for key in self.config.warmup:
            self.prefetch(key)

    def close(self) -> None:
        self._loader.close()

    def acquire(
        self, key: str, rank: int, tenant: str | None = None, slo: Slo = "interactive", slot_limit: int | None = None,
        hard: bool = False,
    ) -> Lookup:  # fmt: skip
        """Count one request in flight on ``key`` and look it up; a miss starts (or joins) its load.

        ``slot_limit``: the tenant's GPU slot quota per rank class; at it, the tenant evicts its own first, and
        with ``hard`` only its own: the load waits for one of them to be released rather than evict another's.
        Each acquire needs one release. Raises AdapterRevoked while an invalidated version drains.
        """
        entry = Entry(key, rank, tenant, slo, slot_limit, hard)
        with self._lock:
            if self._revoked(key):
                raise AdapterRevoked(f"adapter {key} was invalidated")
            now = self._clock()
            self._refs[key] += 1
            self._slots.policy.touch(key, now)
            self._cpu.policy.touch(key, now)
            tier: Tier = "gpu" if key in self._slots else "cpu" if key in self._cpu else "miss"
            self._counters.lookup(tier)
            if tier == "gpu":
                resident = self._slots.update(entry)
                future: Future[Resident] = Future()
                future.set_result(Resident(self.manager.slot_of(key), resident.digest))  # type: ignore[arg-type]
                return Lookup(tier, future)
            load = self._loader.loads.get(key)
            if load is None:
                load = self._loader.start(entry, prefetch=False, now=now)
            else:
                load.prefetch = False
                fetched = load.weights is not None
                load.entry = replace(entry, rank=load.entry.rank if fetched else rank, digest=load.entry.digest)
            return Lookup(tier, load.future)

    def release(self, key: str) -> None:
        """One request on ``key`` ended. Raises KeyError when none was in flight."""
        with self._lock:
            if self._refs[key] < 1:
                raise KeyError(f"no request in flight on {key}")
            self._refs[key] -= 1
            if self._refs[key]:
                return
            del self._refs[key]
            if key in self._draining:
                self._draining.discard(key)
                self._loader.unload(key, "invalidated")
            ready = self._loader.drain(self._clock())
        self._loader.submit(ready)

    def prefetch(self, key: str, tenant: str | None = None, slo: Slo = "interactive") -> bool:
        """Load ``key`` into the CPU tier, and into a slot when one is free or a colder evictable adapter
        can leave; False when it is resident or loading already."""
        with self._lock:
            if key in self._slots or key in self._loader.loads or self._revoked(key):
                return False
            self._loader.start(Entry(key, 0, tenant, slo), prefetch=key not in self._pins, now=self._clock())
            return True

    def evict(self, key: str) -> EvictOutcome:
        """Free ``key``'s slot (its CPU copy stays): ``done``; or why not (not resident, pinned, in flight)."""
        with self._lock:
            if key not in self._slots:
                return "not_resident"
            if key in self._pins:
                return "pinned"
            if self._refs[key] > 0:
                return "in_flight"
            self._loader.unload(key, "directive")
            ready = self._loader.drain(self._clock())
        self._loader.submit(ready)
        return "done"

    def pin(self, key: str, rank: int | None = None, tenant: str | None = None) -> bool:
        """Never evict ``key``; it is loaded if absent (again, if a load failed), waiting for a slot like a request.

        False, pinning nothing, when the pins of its rank class already hold every slot of it but one. The cap
        needs the class: from ``rank``, else the resident copy; without either (no rank given, not resident)
        the pin is taken uncapped, so callers that can (the worker's pin follower does) give the rank.
        """
        with self._lock:
            rank_class = self._slots.class_of(rank) if rank is not None else self._slots.class_of_key(key)
            if key not in self._pins and rank_class is not None:
                pinned = sum(c == rank_class for c in self._pins.values())
                if pinned >= self._slots.slots[rank_class] - 1:
                    self._pins_refused.add(key)
                    return False
            self._pins[key] = rank_class
            self._pins_refused.discard(key)
            load = self._loader.loads.get(key)
            if load is not None:
                load.prefetch = False
            elif key not in self._slots and not self._revoked(key):
                self._loader.start(Entry(key, rank or 0, tenant), prefetch=False, now=self._clock())
            return True

    def unpin(self, key: str) -> None:
        with self._lock:
            self._pins.pop(key, None)
            self._pins_refused.discard(key)
            ready = self._loader.drain(self._clock())
        self._loader.submit(ready)

    def invalidate(self, adapter_id: str, version: int | None = None) -> list[str]:
        """Drop one version (None: every version) of an adapter from every tier at once; the keys it held.

        Idle slots are freed now; a slot with requests in flight is freed on their last release, and
        the key refuses new acquires (AdapterRevoked) until then: the worker should cancel those
        requests. Pending loads fail with AdapterRevoked.
        """

        def match(key: str) -> bool:
            return key == adapter_key(adapter_id, version) if version is not None else adapter_of_key(key) == adapter_id

        with self._lock:
            # the tiers are not mappings: keys() is their only iteration
            keys = {key for key in self._cpu.keys() if match(key)}  # noqa: SIM118
            for key in keys:
                self._cpu.remove(key)
                self._counters.evicted("cpu", "invalidated")
            for key in [key for key in self._slots.keys() if match(key)]:  # noqa: SIM118
                keys.add(key)
                if self._refs[key] > 0:
                    self._draining.add(key)
                else:
                    self._loader.unload(key, "invalidated")
            cancelled = [load for key, load in self._loader.loads.items() if match(key)]
            for load in cancelled:
                self._loader.cancel(load)
                keys.add(load.entry.key)
            for key in keys:
                self._pins.pop(key, None)
                self._slots.policy.forget(key)
                self._cpu.policy.forget(key)
            metrics.ADAPTER_CPU_TIER_BYTES.set(self._cpu.nbytes)
            ready = self._loader.drain(self._clock())
        for load in cancelled:
            settle(load.future, error=AdapterRevoked(f"adapter {load.entry.key} was invalidated"))
        self._loader.submit(ready)
        return sorted(keys)

    def update_heat(self, heat: Mapping[str, float]) -> None:
        """Fleet heat from the scheduler: adapter key -> decayed requests/s."""
        with self._lock:
            self._slots.policy.update_heat(heat)
            self._cpu.policy.update_heat(heat)

    def stats(self) -> CacheStats:
        with self._lock:
            c = self._counters
            return CacheStats(
                gpu_adapters=self._slots.keys(), cpu_adapters=self._cpu.keys(), pinned=sorted(self._pins),
                pins_refused=sorted(self._pins_refused),
                in_flight=dict(self._refs), loading=list(self._loader.loads),
                waiting_for_slot=sum(len(q) for q in self._loader.queues.values()), lookups=dict(c.lookups),
                hit_ratio=c.hit_ratio(), loads=dict(c.loads), load_ms_mean=c.load_ms_mean(),
                slot_wait_ms_mean=c.slot_wait_ms / c.slot_waits if c.slot_waits else 0.0,
                evictions=dict(c.evictions), cpu_bytes=self._cpu.nbytes,
                slots={r: (self._slots.used(r), n) for r, n in self._slots.slots.items()},
                slot_bytes=dict(self._slot_bytes),
            )  # fmt: skip

    def _protected(self, key: str) -> bool:
        return self._refs[key] > 0 or key in self._pins

    def _revoked(self, key: str) -> bool:
        """Invalidated, and its slot not yet freed (requests in flight, or a copy still landing)."""
        return key in self._draining or key in self._loader.undoing
