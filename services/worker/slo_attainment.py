"""Whether each request met its SLO class's time-to-first-token target, over a bounded recent window."""

import time
from collections import deque
from typing import Literal

from shared import metrics
from shared.schemas import SLO_CLASSES, SloClass

SloOutcome = Literal["met", "missed"]


def ttft_outcome(
    created_at: float, first_token_wall: float | None, target_s: float | None, failed: bool
) -> SloOutcome | None:
    """``met``, ``missed``, or None when the request does not count: it had no target, or it was
    cancelled without a token before its target passed (the client left; the platform was not late).

    Measured end to end from ``created_at`` (the scheduler's admission wall time) to the first token.
    A request that failed without a token, or had none when its target passed, missed it."""
    if target_s is None:
        return None
    if first_token_wall is not None:
        return "met" if first_token_wall - created_at <= target_s else "missed"
    if failed or time.time() - created_at > target_s:
        return "missed"
    return None


class SloAttainment:
    """Per class, the outcomes of its last ``window`` counted requests: the ``slo_attainment_ratio``
    gauge is their share that met the target; ``slo_requests`` counts every outcome since start."""

    def __init__(self, window: int = 500):
        self._recent: dict[str, deque[bool]] = {c: deque(maxlen=window) for c in SLO_CLASSES}

    def record(self, slo_class: SloClass, outcome: SloOutcome) -> float:
        """Count one outcome; the class's attainment ratio over its window."""
        recent = self._recent[slo_class]
        recent.append(outcome == "met")
        ratio = sum(recent) / len(recent)
        metrics.SLO_REQUESTS.labels(slo_class, outcome).inc()
        metrics.SLO_ATTAINMENT.labels(slo_class).set(ratio)
        return ratio
