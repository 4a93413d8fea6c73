"""The fleet's rank classes as the registry admits pushes by them: those the live workers of its base
model announce in their heartbeats, or the configured LF_FLEET_RANK_CLASSES while none is live."""

import time
from dataclasses import dataclass, field

from shared.schemas import WorkerHeartbeat


@dataclass(frozen=True, slots=True)
class RankClasses:
    classes: tuple[int, ...]  # ascending
    source: str  # where they came from, for a refusal's reason

    def describe(self) -> str:
        return f"{', '.join(map(str, self.classes)) or 'none'} ({self.source})"


@dataclass(slots=True)
class FleetRanks:
    base_model: str
    configured: tuple[int, ...]
    timeout_s: float
    _workers: dict[str, tuple[float, tuple[int, ...]]] = field(default_factory=dict)  # id -> (seen, classes)

    def heartbeat(self, beat: WorkerHeartbeat, now: float | None = None) -> None:
        """A worker's classes: its slot classes, up to its engine's announced rank limit."""
        if beat.base_model != self.base_model:
            return
        if not beat.ready:
            self._workers.pop(beat.worker_id, None)
            return
        limit = beat.capability.max_lora_rank
        classes = tuple(sorted(c for c in map(int, beat.slots) if limit is None or c <= limit))
        self._workers[beat.worker_id] = (time.monotonic() if now is None else now, classes)

    def current(self, now: float | None = None) -> RankClasses:
        now = time.monotonic() if now is None else now
        self._workers = {w: seen for w, seen in self._workers.items() if now - seen[0] <= self.timeout_s}
        if not self._workers:
            return RankClasses(self.configured, "LF_FLEET_RANK_CLASSES, no worker live")
        live = {c for _, classes in self._workers.values() for c in classes}
        return RankClasses(tuple(sorted(live)), f"{len(self._workers)} live workers")
