"""Submissions fetched from the work queue but not yet admitted, one FIFO per tenant, taken in
round-robin turn across tenants.

The work queue delivers in arrival order, so without this a tenant that floods it puts its whole
backlog ahead of everyone's next request. Fetching is cheap and admission is not (a Redis round
trip, maybe a registry one): the scheduler fetches past a flood into these queues and admits one
request per tenant per turn, so another tenant's request waits for at most one admission per
backlogged tenant, however many the flood holds. A tenant's queue is bounded (``per_tenant``); a
submission beyond it is refused at once rather than held."""

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Waiting(Generic[T]):
    item: T
    fetched: float  # monotonic time it was fetched, or last kept alive


@dataclass(slots=True)
class Intake(Generic[T]):
    per_tenant: int
    _queues: dict[str, deque[Waiting[T]]] = field(default_factory=dict)  # in turn order: next tenant first

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Waiting[T]]:
        for q in self._queues.values():
            yield from q

    def push(self, tenant: str, item: T, now: float) -> bool:
        """Queue ``item`` behind the tenant's others; False (nothing queued) when its queue is full."""
        q = self._queues.setdefault(tenant, deque())
        if len(q) >= self.per_tenant:
            return False
        q.append(Waiting(item, now))
        return True

    def pop(self, admissible: Callable[[str], bool] = lambda _: True) -> T | None:
        """The oldest item of the first tenant in turn that ``admissible`` lets in; that tenant's turn
        then goes to the back. None when no tenant is admissible."""
        for tenant in list(self._queues):
            if not admissible(tenant):
                continue
            q = self._queues.pop(tenant)
            waiting = q.popleft()
            if q:
                self._queues[tenant] = q  # re-inserted: last in turn
            return waiting.item
        return None

    def tenants(self) -> set[str]:
        return set(self._queues)

    def stale(self, now: float, older_than_s: float) -> list[T]:
        """Items fetched (or kept alive) more than ``older_than_s`` ago, now marked kept alive."""
        found = []
        for waiting in self:
            if now - waiting.fetched >= older_than_s:
                waiting.fetched = now
                found.append(waiting.item)
        return found

    def take_all(self) -> list[T]:
        items = [w.item for w in self]
        self._queues.clear()
        return items
