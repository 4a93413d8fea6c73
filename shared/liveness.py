"""Who is alive, from heartbeats: a peer silent past the timeout is dead."""

import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Liveness(Generic[T]):
    timeout_s: float
    _last: dict[str, tuple[float, T]] = field(default_factory=dict)

    def seen(self, key: str, info: T, now: float | None = None) -> None:
        self._last[key] = (time.monotonic() if now is None else now, info)

    def forget(self, key: str) -> None:
        self._last.pop(key, None)

    def alive(self, now: float | None = None) -> dict[str, T]:
        """Live peers and their latest info; dead ones are dropped."""
        now = time.monotonic() if now is None else now
        dead = [k for k, (ts, _) in self._last.items() if now - ts > self.timeout_s]
        for k in dead:
            del self._last[k]
        return {k: info for k, (_, info) in self._last.items()}

    def is_alive(self, key: str, now: float | None = None) -> bool:
        return key in self.alive(now)
