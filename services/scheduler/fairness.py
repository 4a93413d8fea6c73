"""Fair queueing across tenants with virtual token counters (VTC, "Fairness in Serving Large
Language Models", OSDI '24) inside two priority classes.

Each tenant has a counter charged ``input_weight`` per prompt token and ``output_weight`` per
generated token. The backlogged tenant with the lowest counter is served next; a tenant that
returns from idle is lifted to the lowest active counter, so idling earns no credit. Interactive
requests go before batch ones, except a batch request waiting past its SLO target, which then
ranks as interactive (batch never starves)."""

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from shared.schemas import SloClass

Priority = SloClass


class Queueable(Protocol):
    @property
    def tenant(self) -> str: ...
    @property
    def priority(self) -> Priority: ...
    @property
    def request_id(self) -> str: ...
    @property
    def enqueued(self) -> float: ...


Q = TypeVar("Q", bound=Queueable)


@dataclass(slots=True)
class FairQueue(Generic[Q]):
    input_weight: float = 1.0
    output_weight: float = 2.0
    batch_slo_s: float = 30.0
    counters: dict[str, float] = field(default_factory=dict)
    _queues: dict[str, deque[Q]] = field(default_factory=dict)  # tenant -> FIFO of its requests
    _floor: float = 0.0  # the lowest counter last seen active: where a returning tenant starts

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Q]:
        for q in self._queues.values():
            yield from q

    def push(self, item: Q, front: bool = False) -> None:
        """Queue ``item``; ``front`` puts back one that could not be placed after all (it keeps its turn)."""
        tenant = item.tenant
        if tenant not in self._queues:
            active = [self.counters.get(t, 0.0) for t in self._queues]
            floor = min(active) if active else self._floor
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            self._queues[tenant] = deque()
        if front:
            self._queues[tenant].appendleft(item)
        else:
            self._queues[tenant].append(item)

    def pop(self, now: float, placeable: Callable[[Q], bool]) -> Q | None:
        """The next request by class then counter, among each tenant's oldest placeable ones; None if none."""
        heads = []
        for tenant, q in self._queues.items():
            ranked = [(self._class_rank(item, now), item.enqueued, item) for item in q if placeable(item)]
            if ranked:
                rank, enqueued, head = min(ranked, key=lambda r: r[:2])
                heads.append((rank, self.counters.get(tenant, 0.0), enqueued, head))
        if not heads:
            return None
        item = min(heads, key=lambda h: h[:3])[3]
        self._take(item)
        return item

    def charge(self, tenant: str, input_tokens: float, output_tokens: float) -> None:
        """Add served tokens to the tenant's counter (negative corrects an earlier estimate)."""
        self.counters[tenant] = (
            self.counters.get(tenant, 0.0) + self.input_weight * input_tokens + self.output_weight * output_tokens
        )

    def remove(self, ref: tuple[str, str]) -> Q | None:
        """Take out the item of (tenant, request id), if queued."""
        tenant, request_id = ref
        for item in self._queues.get(tenant, ()):
            if item.request_id == request_id:
                self._take(item)
                return item
        return None

    def take_where(self, doomed: Callable[[Q], bool]) -> list[Q]:
        """Remove and return every queued item ``doomed`` selects."""
        found = [item for item in self if doomed(item)]
        for item in found:
            self._take(item)
        return found

    def _class_rank(self, item: Q, now: float) -> int:
        return 0 if item.priority == "interactive" or now - item.enqueued > self.batch_slo_s else 1

    def _take(self, item: Q) -> None:
        q = self._queues[item.tenant]
        q.remove(item)
        if not q:
            del self._queues[item.tenant]
            active = [self.counters[t] for t in self._queues]
            self._floor = min(active) if active else self.counters.get(item.tenant, 0.0)
