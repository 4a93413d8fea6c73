"""The rank-skew gauge: how much slower steps that read a high rank class run than same-size steps
at the lowest class alone, from running means per (highest class, batch-token bucket)."""

from dataclasses import dataclass

from shared import metrics


def token_bucket(num_tokens: int) -> int:
    """The step's token count rounded up to a power of two: steps of one bucket are compared."""
    return 1 << max(0, num_tokens - 1).bit_length()


@dataclass(slots=True)
class RunningMean:
    count: int = 0
    mean: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        self.mean += (value - self.mean) / self.count


class RankSkew:
    """Feeds ``engine_rank_skew_ratio``; not thread-safe (the engine's step loop owns it)."""

    def __init__(self, lowest_class: int):
        self.lowest = lowest_class
        self._means: dict[tuple[int, int], RunningMean] = {}  # (highest class, bucket) -> step ms

    def observe(self, ranks: tuple[int, ...], num_tokens: int, step_ms: float) -> None:
        """One step that read adapters of rank classes ``ranks`` (ascending) over ``num_tokens`` tokens."""
        if not ranks:
            return
        high, bucket = ranks[-1], token_bucket(num_tokens)
        self._means.setdefault((high, bucket), RunningMean()).add(step_ms)
        if high == self.lowest:
            for (rank_class, b), mean in self._means.items():
                if b == bucket and rank_class != self.lowest:
                    self._publish(rank_class, bucket, mean.mean)
        else:
            self._publish(high, bucket, self._means[(high, bucket)].mean)

    def ratio(self, rank_class: int, num_tokens: int) -> float | None:
        """The gauge's value for ``rank_class`` at ``num_tokens``'s bucket (None: a side not yet seen)."""
        bucket = token_bucket(num_tokens)
        high, low = self._means.get((rank_class, bucket)), self._means.get((self.lowest, bucket))
        return high.mean / low.mean if high and low and low.mean > 0 else None

    def _publish(self, rank_class: int, bucket: int, mean: float) -> None:
        low = self._means.get((self.lowest, bucket))
        if low is not None and low.mean > 0:
            metrics.RANK_SKEW.labels(str(rank_class), str(bucket)).set(mean / low.mean)
