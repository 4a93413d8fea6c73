"""Exponentially decayed request rates: the heat the scheduler publishes and the workers' heat policy scores by."""

import math


class DecayedRate:
    """Per-key event rate with exponential decay: each event adds 1, halving every ``half_life_s``.

    rate(key, t) = ln2 / half_life * sum over events e of 2^-((t - t_e) / half_life), in events per second:
    a key requested steadily at r per second converges to rate r. Not thread-safe.
    """

    __slots__ = ("_bumps", "_lambda", "_state", "floor", "half_life_s")

    def __init__(self, half_life_s: float, floor: float = 1e-3):
        self.half_life_s = half_life_s
        self._lambda = math.log(2) / half_life_s  # decay constant, also count -> rate
        self.floor = floor  # decayed counts below this are forgotten
        self._state: dict[str, tuple[float, float]] = {}  # key -> (decayed count at t, t)
        self._bumps = 0

    def bump(self, key: str, now: float, weight: float = 1.0) -> None:
        count, then = self._state.get(key, (0.0, now))
        self._state[key] = (self._decay(count, now - then) + weight, now)
        self._bumps += 1
        if self._bumps % 4096 == 0:
            self.prune(now)

    def rate(self, key: str, now: float) -> float:
        state = self._state.get(key)
        if state is None:
            return 0.0
        return self._decay(state[0], now - state[1]) * self._lambda

    def snapshot(self, now: float) -> dict[str, float]:
        """Every key's rate at ``now``: what a heat publisher sends to the workers' ``update_heat``."""
        return {key: self.rate(key, now) for key in self._state}

    def forget(self, key: str) -> None:
        self._state.pop(key, None)

    def prune(self, now: float) -> None:
        """Forget keys whose decayed count fell below the floor: memory stays bounded by the active keys."""
        cold = [key for key, (count, then) in self._state.items() if self._decay(count, now - then) < self.floor]
        for key in cold:
            del self._state[key]

    def _decay(self, count: float, elapsed: float) -> float:
        return count * math.exp(-self._lambda * max(elapsed, 0.0))
