"""Slot loads beside the engine's step loop: fetch (CPU tier or store), reserve a slot or wait, copy.

One load per adapter at a time, shared by every request that waits on it. A load reserves a slot
of its rank class, evicting at most one unprotected victim; when the class has none, it joins the
class's FIFO (by arrival) and the next release that frees a slot drains it. A prefetch never queues and never
evicts an adapter the policy scores higher. A load of a tenant held to a hard slot quota waits in the FIFO for
one of its own slots without holding up the loads queued behind it.
"""

import bisect
import itertools
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from services.worker.adapter_cache.backend import Cached, SlotBackend
from services.worker.adapter_cache.cpu_tier import CpuTier
from services.worker.adapter_cache.policy import Entry
from services.worker.adapter_cache.slot_tier import SlotTier
from services.worker.adapter_cache.stats import CacheCounters, Source
from shared import metrics
from shared.errors import ServiceUnavailable

LoadFromStore = Callable[[str], Cached]  # key -> fetched, verified adapter; raises IntegrityError


@dataclass(frozen=True, slots=True)
class Resident:
    """An adapter in its slot: what a lookup's ``ready`` resolves to."""

    slot: int
    digest: str | None  # the weights in the slot (Cached.digest)


@dataclass(slots=True, eq=False)
class Load:
    seq: int  # arrival order: loads wait for a slot in this order, whichever fetch finished first
    entry: Entry  # rank is the weights' once fetched
    future: Future[Resident]  # the slot and digest, or the error that ended the load
    prefetch: bool  # nobody waits on it: it never queues for a slot nor evicts a hotter adapter
    started: float
    source: Source = "store"
    weights: Cached | None = None
    queued_at: float = 0.0
    copying: bool = False  # holds a reserved slot: manager.load_adapter may be running
    reserved_for: str | None = None  # the tenant whose quota the reserved slot counts toward
    cancelled: bool = False


class SlotLoader:
    """The load pipeline on its own threads. start, cancel, drain and unload expect ``lock`` held; submit and close
    run without it."""

    def __init__(self, manager: SlotBackend, load_from_store: LoadFromStore, slots: SlotTier, cpu: CpuTier,
                 counters: CacheCounters, lock: threading.Lock, clock: Callable[[], float],
                 protected: Callable[[str], bool], threads: int):  # fmt: skip
        self.manager = manager
        self.loads: dict[str, Load] = {}
        self.queues: dict[int, deque[Load]] = {rank: deque() for rank in slots.slots}
        self.undoing: set[str] = set()  # cancelled while copying: the key may not load again until undone
        self._load_from_store = load_from_store
        self._slots, self._cpu, self._counters = slots, cpu, counters
        self._lock, self._clock, self._protected = lock, clock, protected
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="adapter-load")
        self._arrivals = itertools.count()

    def close(self) -> None:
        """Stop the loader threads; loads that never ran fail with ServiceUnavailable."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            pending = list(self.loads.values())
        for load in pending:
            settle(load.future, error=_shutting_down(load))

    def start(self, entry: Entry, prefetch: bool, now: float) -> Load:
        load = Load(next(self._arrivals), entry, Future(), prefetch, now)
        self.loads[entry.key] = load
        self._run(self._fetch, load)
        return load

    def cancel(self, load: Load) -> None:
        """Abandon a load: it leaves its queue, and a copy in progress is undone when it lands."""
        load.cancelled = True
        del self.loads[load.entry.key]
        if load.copying:
            self.undoing.add(load.entry.key)
        for queue in self.queues.values():
            if load in queue:
                queue.remove(load)

    def drain(self, now: float) -> list[Load]:
        """Reserve slots for queued loads, head first, while their rank class has room; pass them to submit."""
        ready: list[Load] = []
        for queue in self.queues.values():
            for load in list(queue):
                if self._room(load.entry, now, prefetch=False):
                    queue.remove(load)
                    self._reserve(load)
                    self._counters.waited((now - load.queued_at) * 1000)
                    ready.append(load)
                elif not self._slots.held_to_quota(load.entry):
                    break  # the class is full for everyone: the loads behind it wait their turn
        return ready

    def submit(self, ready: list[Load]) -> None:
        """Copy drained loads into their slots (call without the lock: nothing here needs it)."""
        for load in ready:
            self._run(self._copy, load)

    def unload(self, key: str, reason: str) -> None:
        self.manager.unload(key)
        self._slots.remove(key)
        self._counters.evicted("gpu", reason)
        self._occupancy()

    def _run(self, step: Callable[[Load], None], load: Load) -> None:
        try:
            self._executor.submit(step, load)
        except RuntimeError:  # closed: no loader thread will ever run it
            settle(load.future, error=_shutting_down(load))

    def _fetch(self, load: Load) -> None:
        key = load.entry.key
        try:
            with self._lock:
                weights = self._cpu.get(key)
            if weights is not None:
                load.source = "cpu"
            else:
                weights = self._load_from_store(key)
                with self._lock:
                    if load.cancelled:
                        return
                    for _ in self._cpu.put(replace(load.entry, rank=weights.rank), weights, self._clock()):
                        self._counters.evicted("cpu", "capacity")
                    metrics.ADAPTER_CPU_TIER_BYTES.set(self._cpu.nbytes)
            with self._lock:
                if load.cancelled:
                    return
                load.weights, load.entry = weights, replace(load.entry, rank=weights.rank, digest=weights.digest)
                placed = self._place(load, self._clock())
        except Exception as error:  # the store's and the verifier's errors reach the waiters
            self._fail(load, error)
            return
        if placed:
            self._copy(load)

    def _place(self, load: Load, now: float) -> bool:
        """Reserve a slot for ``load``, or queue it; a prefetch never queues."""
        queue = self.queues[self._slots.class_of(load.entry.rank)]
        ahead = [queued for queued in queue if not self._slots.held_to_quota(queued.entry)]
        if not ahead and self._room(load.entry, now, load.prefetch):
            self._reserve(load)
            return True
        if load.prefetch:
            del self.loads[load.entry.key]
            load.future.cancel()
        else:
            if self._slots.held_to_quota(load.entry):
                metrics.ADAPTER_QUOTA_WAITS.inc()
            load.queued_at = now
            bisect.insort(queue, load, key=lambda queued: queued.seq)
        return False

    def _reserve(self, load: Load) -> None:
        self._slots.reserve(self._slots.class_of(load.entry.rank), load.entry.tenant)
        load.copying, load.reserved_for = True, load.entry.tenant

    def _room(self, entry: Entry, now: float, prefetch: bool) -> bool:
        """Whether entry's rank class has a slot free, evicting the policy's victim if needed; a tenant held to
        its hard quota takes no free slot beyond it, only one of its own."""
        if self._slots.free(self._slots.class_of(entry.rank)) > 0 and not self._slots.held_to_quota(entry):
            return True
        victim = self._slots.victim(entry, now, self._protected)
        policy = self._slots.policy
        if victim is None or (prefetch and policy.score(victim, now) >= policy.score(entry, now)):
            return False
        self.unload(victim.key, "capacity")
        return True

    def _copy(self, load: Load) -> None:
        key, rank_class = load.entry.key, self._slots.class_of(load.entry.rank)
        try:
            slot = self.manager.load_adapter(key, load.weights)  # type: ignore[arg-type]
        except Exception as error:
            with self._lock:
                self._slots.unreserve(rank_class, load.reserved_for)
                self.undoing.discard(key)
                ready = self.drain(self._clock())
            self._fail(load, error)
            self.submit(ready)
            return
        with self._lock:
            if load.cancelled:
                self.manager.unload(key)
                self._slots.unreserve(rank_class, load.reserved_for)
                self.undoing.discard(key)
            else:
                self._slots.commit(load.entry, load.reserved_for)
                del self.loads[key]
                self._counters.loaded(load.source, (self._clock() - load.started) * 1000)
                self._occupancy()
            ready = self.drain(self._clock())
        if not load.cancelled:
            settle(load.future, resident=Resident(slot, load.entry.digest))
        self.submit(ready)

    def _fail(self, load: Load, error: Exception) -> None:
        with self._lock:
            if self.loads.get(load.entry.key) is load:
                del self.loads[load.entry.key]
        settle(load.future, error=error)

    def _occupancy(self) -> None:
        for rank_class, slots in self._slots.slots.items():
            metrics.SLOT_OCCUPANCY.labels(str(rank_class)).set(self._slots.used(rank_class) / slots)


def _shutting_down(load: Load) -> ServiceUnavailable:
    return ServiceUnavailable(f"adapter {load.entry.key}: the worker is shutting down")


def settle(future: Future[Resident], *, resident: Resident | None = None, error: Exception | None = None) -> None:
    """Resolve a load's future once; an invalidation may have failed it already."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(resident)  # type: ignore[arg-type]
