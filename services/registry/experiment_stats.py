"""Per-arm figures of experiments across adapters, from the completion and feedback audit records
(``CompletionAudit.experiment`` / ``arm``, set by the scheduler's routing step), each with a 95%
confidence interval kept simple:

- a rate or share (arm share, complaint rate): the Wilson score interval;
- a median (TTFT, TPOT): the distribution-free order-statistic interval, the sorted values at
  (1-based) ranks ``floor(n/2 - 1.96 sqrt(n)/2)`` and ``ceil(1 + n/2 + 1.96 sqrt(n)/2)`` (no
  assumption on the latency distribution);
- cost (engine ms per output token, a ratio of sums as in ``live_stats.engine_ms_per_token``): the
  normal approximation of a ratio estimator, ``se = sqrt(sum((e_i - R t_i)^2) / (n (n-1))) / mean(t)``.
"""

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from services.registry.live_stats import MAX_SAMPLES, Sample, engine_ms_per_token, percentile
from shared.schemas import ArmFigures, CompletionAudit, Experiment, FeedbackAudit, Interval

Z95 = 1.959964
MAX_REMEMBERED = 200_000  # request ids whose arm a later rating is attributed by


@dataclass(slots=True)
class ArmTraffic:
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    ratings: dict[str, tuple[float, bool]] = field(default_factory=dict)  # request id -> (ts, complaint)


def wilson(successes: int, n: int) -> Interval:
    if n == 0:
        return Interval()
    p = successes / n
    denominator = 1 + Z95**2 / n
    centre = (p + Z95**2 / (2 * n)) / denominator
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denominator
    return Interval(value=p, low=max(0.0, centre - half), high=min(1.0, centre + half))


def median_interval(values: list[float]) -> Interval:
    if not values:
        return Interval()
    ordered = sorted(values)
    n = len(ordered)
    spread = Z95 * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - spread) - 1)
    high = min(n - 1, math.ceil(1 + n / 2 + spread) - 1)
    return Interval(value=percentile(ordered, 50), low=ordered[low], high=ordered[high])


def cost_interval(served: list[Sample]) -> Interval:
    ratio = engine_ms_per_token(served)
    measured = [s for s in served if s.engine_s is not None and s.completion_tokens]
    if ratio is None or len(measured) < 2:
        return Interval(value=ratio)
    mean_tokens = sum(s.completion_tokens for s in measured) / len(measured)
    residuals = sum(((s.engine_s or 0.0) * 1000 - ratio * s.completion_tokens) ** 2 for s in measured)
    se = math.sqrt(residuals / (len(measured) * (len(measured) - 1))) / mean_tokens
    return Interval(value=ratio, low=max(0.0, ratio - Z95 * se), high=ratio + Z95 * se)


class ExperimentStats:
    """Completions and ratings of experiment traffic, per (tenant, experiment, arm)."""

    def __init__(self) -> None:
        self._arms: dict[tuple[str, str, str], ArmTraffic] = {}
        self._arm_of: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()  # (tenant, request) ->

    def add_completion(self, record: CompletionAudit) -> None:
        if record.experiment is None or record.arm is None or record.outcome == "cancelled":
            return
        key = (record.tenant_id, record.experiment, record.arm)
        self._arms.setdefault(key, ArmTraffic()).samples.append(Sample.of(record))
        self._arm_of[(record.tenant_id, record.request_id)] = (record.experiment, record.arm)
        if len(self._arm_of) > MAX_REMEMBERED:
            self._arm_of.popitem(last=False)

    def add_feedback(self, record: FeedbackAudit) -> None:
        """A rating counts for the arm that served the request (a later one replaces it)."""
        served = self._arm_of.get((record.tenant_id, record.request_id))
        if served is None:
            return
        traffic = self._arms.get((record.tenant_id, *served))
        if traffic is not None:
            traffic.ratings[record.request_id] = (record.ts, record.rating == "down")

    def forget(self, tenant_id: str, name: str) -> None:
        """Drop an experiment's records (it is replaced by a new one of the same name)."""
        for key in [k for k in self._arms if k[:2] == (tenant_id, name)]:
            del self._arms[key]

    def figures(self, experiment: Experiment) -> list[ArmFigures]:
        """Each arm's figures over the records from the experiment's start on."""
        since = experiment.started_at
        windows = {
            arm.name: [s for s in self._traffic(experiment, arm.name).samples if s.ts >= since]
            for arm in experiment.arms
        }
        total = sum(len(w) for w in windows.values())
        return [self._arm(experiment, arm.name, arm.target, windows[arm.name], total) for arm in experiment.arms]

    def _traffic(self, experiment: Experiment, arm: str) -> ArmTraffic:
        return self._arms.get((experiment.tenant_id, experiment.name, arm), ArmTraffic())

    def _arm(self, experiment: Experiment, arm: str, target: str, window: list[Sample], total: int) -> ArmFigures:
        served = [s for s in window if not s.error]
        rated = [c for ts, c in self._traffic(experiment, arm).ratings.values() if ts >= experiment.started_at]
        return ArmFigures(
            arm=arm,
            target=target,
            count=len(window),
            errors=len(window) - len(served),
            share=wilson(len(window), total),
            ttft_p50_ms=median_interval([s.ttft_ms for s in served]),
            ttft_p95_ms=percentile([s.ttft_ms for s in served], 95),
            tpot_p50_ms=median_interval([s.tpot_ms for s in served]),
            engine_ms_per_token=cost_interval(served),
            feedback=len(rated),
            complaint_rate=wilson(min(sum(rated), len(window)), len(window)),
        )
