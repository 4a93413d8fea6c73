"""Fair queueing across tenants with virtual token counters (VTC, "Fairness in Serving Large
Language Models", OSDI '24) inside three SLO classes.

Each tenant has a counter charged ``input_weight`` per prompt token and ``output_weight`` per
generated token. The backlogged tenant with the lowest counter is served next; a tenant that
returns from idle is lifted to the lowest active counter, so idling earns no credit. Interactive
requests go before standard ones and those before batch, except a request waiting past its class's
TTFT target, which then ranks as interactive (no class starves).

With several schedulers the counters are shared (``vtc.SharedCounters``): the queue records what it
charged and whom it lifted since the last hand-off, and adopts the shared values it is given back."""

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from shared.schemas import SloClass, slo_rank

Priority = SloClass
DEFAULT_TARGETS_S: Mapping[str, float] = {"interactive": 2.0, "standard": 8.0, "batch": 60.0}


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
    targets_s: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_TARGETS_S))  # class -> TTFT target
    counters: dict[str, float] = field(default_factory=dict)
    _queues: dict[str, deque[Q]] = field(default_factory=dict)  # tenant -> FIFO of its requests
    _floor: float = 0.0  # the lowest counter last seen active: where a returning tenant starts
    _charged: dict[str, float] = field(default_factory=dict)  # tenant -> charged since the last hand-off
    _lifted: set[str] = field(default_factory=set)  # tenants that became backlogged since the last hand-off

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
            self._lifted.add(tenant)
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
        cost = self.input_weight * input_tokens + self.output_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost
        self._charged[tenant] = self._charged.get(tenant, 0.0) + cost

    def backlogged(self) -> list[str]:
        """Tenants with a request queued here."""
        return list(self._queues)

    def quiet(self) -> bool:
        """Nothing queued here and nothing to hand off: a hand-off would only read the floor."""
        return not (self._queues or self._charged or self._lifted)

    def take_changes(self) -> tuple[dict[str, float], set[str]]:
        """Hand off what was charged (tenant -> amount) and who was lifted since the last hand-off."""
        charged, lifted = self._charged, self._lifted
        self._charged, self._lifted = {}, set()
        return charged, lifted

    def give_back_changes(self, charged: dict[str, float], lifted: set[str]) -> None:
        """Keep changes a hand-off could not deliver, to hand off again with later ones."""
        for tenant, cost in charged.items():
            self._charged[tenant] = self._charged.get(tenant, 0.0) + cost
        self._lifted |= lifted

    def adopt(self, shared: Mapping[str, float], floor: float) -> None:
        """Take the shared counters (as of a hand-off) as this queue's own, plus what was charged here
        since; a tenant lifted here since keeps its lift until the next hand-off carries it."""
        for tenant, value in shared.items():
            value += self._charged.get(tenant, 0.0)
            lifted = tenant in self._lifted
            self.counters[tenant] = max(value, self.counters.get(tenant, 0.0)) if lifted else value
        if not self._queues:
            self._floor = floor

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

    def ahead_of(self, slo_class: SloClass, now: float) -> int:
        """How many queued requests go before a new one of ``slo_class``: those of its class or higher,
        and those promoted for waiting past their target."""
        rank = slo_rank(slo_class)
        return sum(1 for item in self if self._class_rank(item, now) <= rank)

    def _class_rank(self, item: Q, now: float) -> int:
        if now - item.enqueued > self.targets_s[item.priority]:
            return 0  # past its target: it ranks as interactive, so no class starves
        return slo_rank(item.priority)

    def _take(self, item: Q) -> None:
        q = self._queues[item.tenant]
        q.remove(item)
        if not q:
            del self._queues[item.tenant]
            active = [self.counters[t] for t in self._queues]
            self._floor = min(active) if active else self.counters.get(item.tenant, 0.0)
