"""Prefetch and eviction directives from adapter heat: a rising adapter gets another replica once
its holders' share of its rate passes ``hot_rate`` each; a cold adapter held on several workers is
evicted from all but one. At most ``limit`` directives a tick, and never the same one twice in a row."""

import math
from dataclasses import dataclass, field
from typing import Literal

from services.scheduler.placement import Fleet
from shared.adapter_keys import parse_adapter_key
from shared.errors import InvalidRequest
from shared.schemas import WorkerControl

Directive = tuple[str, WorkerControl]  # (worker id, control message)
Action = Literal["prefetch", "evict"]
Planned = tuple[str, Action, str]  # (worker id, action, adapter key)


def _control(action: Action, key: str) -> WorkerControl | None:
    try:
        adapter_id, version = parse_adapter_key(key)
    except InvalidRequest:
        return None
    return WorkerControl(action=action, adapter_id=adapter_id, adapter_version=version)


@dataclass(slots=True)
class Prefetcher:
    hot_rate: float
    cold_rate: float
    limit: int
    _last: set[Planned] = field(default_factory=set)  # sent last tick

    def plan(self, rates: dict[str, float], fleet: Fleet) -> list[Directive]:
        out: list[Planned] = []
        ready = {w: v for w, v in fleet.workers.items() if v.beat.ready}
        for key, rate in sorted(rates.items(), key=lambda kv: -kv[1]):
            holders = [w for w in fleet.holders(key) if w in ready]
            candidates = [w for w, v in ready.items() if w not in holders]
            want = min(len(ready), math.ceil(rate / self.hot_rate))
            if rate < self.hot_rate or len(holders) >= want or not candidates:
                continue
            target = min(
                candidates,
                key=lambda w: (key not in ready[w].beat.cpu_adapters, ready[w].load / ready[w].beat.max_running, w),
            )
            out.append((target, "prefetch", key))
        held = {key for v in ready.values() for key in v.beat.resident_adapters}
        for key in sorted(held):
            holders = sorted((w for w in fleet.holders(key) if w in ready), key=lambda w: (ready[w].load, w))
            if rates.get(key, 0.0) < self.cold_rate and len(holders) > 1:
                out.extend((w, "evict", key) for w in holders[1:])
        fresh = [d for d in out if d not in self._last][: self.limit]
        self._last = set(fresh)
        return [(w, c) for w, action, key in fresh if (c := _control(action, key)) is not None]
