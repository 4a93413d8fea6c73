"""GPU slot residency per rank class: who holds a slot, copies in flight, and who leaves for a newcomer.

Bookkeeping only: the hierarchy performs the copies and unloads on the AdapterManager, and the
trace simulator drives the same class, so both exercise one eviction path.
"""

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace

from services.worker.adapter_cache.policy import Entry, EvictionPolicy
from shared.errors import IntegrityError

QuotaFn = Callable[[str | None, int], int]  # (tenant, slots of the rank class) -> slots it may hold


class SlotTier:
    """Residents and reservations of each rank class; victim choice by policy and tenant quota. Not thread-safe."""

    __slots__ = ("_quota", "_reserved", "_reserved_by", "_residents", "policy", "slots")

    def __init__(self, class_slots: Mapping[int, int], policy: EvictionPolicy, quota: QuotaFn | None = None):
        self.policy = policy
        self.slots = dict(sorted(class_slots.items()))  # rank class -> slot count
        self._quota = quota
        self._residents: dict[int, dict[str, Entry]] = {rank: {} for rank in self.slots}
        self._reserved = dict.fromkeys(self.slots, 0)
        self._reserved_by: dict[int, Counter[str | None]] = {rank: Counter() for rank in self.slots}  # tenant -> copies

    def class_of(self, rank: int) -> int:
        """The smallest rank class >= rank."""
        for rank_class in self.slots:
            if rank <= rank_class:
                return rank_class
        raise IntegrityError(f"adapter rank {rank} is above the admitted maximum {max(self.slots)}", param="r")

    def class_of_key(self, key: str) -> int | None:
        """The rank class ``key`` is resident in, if it is."""
        return next((rank for rank, residents in self._residents.items() if key in residents), None)

    def __contains__(self, key: str) -> bool:
        return any(key in residents for residents in self._residents.values())

    def keys(self) -> list[str]:
        return [key for residents in self._residents.values() for key in residents]

    def used(self, rank_class: int) -> int:
        """Slots of the class holding an adapter."""
        return len(self._residents[rank_class])

    def free(self, rank_class: int) -> int:
        """Slots neither held nor reserved for a copy in progress."""
        return self.slots[rank_class] - len(self._residents[rank_class]) - self._reserved[rank_class]

    def reserve(self, rank_class: int, tenant: str | None = None) -> None:
        """Hold a free slot for a copy in progress; it counts toward ``tenant``'s quota until it lands."""
        if self.free(rank_class) < 1:
            raise RuntimeError(f"rank class {rank_class} has no free slot to reserve")
        self._reserved[rank_class] += 1
        self._reserved_by[rank_class][tenant] += 1

    def unreserve(self, rank_class: int, tenant: str | None = None) -> None:
        self._reserved[rank_class] -= 1
        self._reserved_by[rank_class][tenant] -= 1

    def commit(self, entry: Entry, reserved_for: str | None = None) -> None:
        """A reserved slot (reserved for the tenant ``reserved_for``) now holds ``entry``."""
        rank_class = self.class_of(entry.rank)
        self.unreserve(rank_class, reserved_for)
        self._residents[rank_class][entry.key] = entry

    def update(self, entry: Entry) -> Entry:
        """Refresh a resident's tenant / SLO class (a request told more than a prefetch knew); the resident
        as now held (its rank and digest are the weights', never the request's)."""
        for residents in self._residents.values():
            held = residents.get(entry.key)
            if held is not None:
                residents[entry.key] = replace(entry, rank=held.rank, digest=held.digest)
                return residents[entry.key]
        raise KeyError(f"{entry.key} is not resident")

    def remove(self, key: str) -> Entry | None:
        for residents in self._residents.values():
            if key in residents:
                return residents.pop(key)
        return None

    def victim(self, incoming: Entry, now: float, protected: Callable[[str], bool]) -> Entry | None:
        """The resident of incoming's rank class to evict for it, or None when every one is protected.

        When incoming's tenant already holds its quota of the class, its own coldest goes first; under a
        hard quota only its own may go, and None (wait) when all of them are protected.
        """
        rank_class = self.class_of(incoming.rank)
        candidates = [e for e in self._residents[rank_class].values() if not protected(e.key)]
        if self.at_quota(incoming):
            own_candidates = [e for e in candidates if e.tenant == incoming.tenant]
            candidates = own_candidates if incoming.hard else own_candidates or candidates
        return self.policy.victim(candidates, now)

    def at_quota(self, incoming: Entry) -> bool:
        """Whether incoming's tenant already holds its slot quota of incoming's rank class."""
        if self._quota is None or incoming.tenant is None:
            return False
        rank_class = self.class_of(incoming.rank)
        quota = self._quota(incoming.tenant, self.slots[rank_class])
        if incoming.slot_limit is not None:
            quota = min(quota, incoming.slot_limit)
        held = sum(e.tenant == incoming.tenant for e in self._residents[rank_class].values())
        return held + self._reserved_by[rank_class][incoming.tenant] >= quota

    def held_to_quota(self, incoming: Entry) -> bool:
        """A hard-quota tenant at its quota: it waits for its own slots and holds up nobody else's load."""
        return incoming.hard and self.at_quota(incoming)
