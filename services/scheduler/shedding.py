"""Early load shedding by SLO class.

Past the fleet's capacity a queue only grows: every request admitted waits longer than the one before,
and all of them miss their targets together. Instead the scheduler estimates, at admission, how long a
new request would wait for a worker, from the fleet's measured service and the queue ahead of it, and
refuses at once (429 ``overloaded`` with Retry-After) what would miss its class's TTFT target. What it
admits keeps its target; what it refuses is told within the admission's own time, not after a timeout.

- Service rate, by Little's law: ``mu = running / service_s``, with ``running`` this scheduler's
  requests on workers and ``service_s`` the mean time from dispatch to end (an EWMA over completions).
  While requests queue the fleet is saturated, so ``running`` is its capacity and ``mu`` its rate.
- A queued request is overtaken by every later arrival of a higher class, so a class is left the
  capacity those do not take: ``mu_c = mu - lambda_above(c)``, ``lambda`` the decayed admission rate per
  class. The wait of a new request is ``(ahead + 1) / mu_c`` (``ahead``: queued requests that go before
  it), none when fewer go before it than the fleet has free sequences for it (``free``: a burst of
  arrivals is admitted before the first of them is dispatched, so each finds the earlier ones queued). Batch is shed first: it is overtaken by
  every class and left the least capacity.
- Predicted TTFT = the time it already waited to be admitted (since the work queue stored it) + the
  wait + the mean worker-side TTFT (prefill, adapter load: the completions' ttft_ms). It is admitted
  while that is within ``margin`` of its target: admitting up to the target itself would have about
  half of the requests admitted at the edge miss it. A request that will not queue (fewer before it
  than free sequences) is never refused.

No estimate, no shedding: until ``min_samples`` requests have completed, everything is admitted."""

from dataclasses import dataclass, field

from shared import metrics
from shared.config import SloTargets
from shared.decay import DecayedRate
from shared.errors import Overloaded
from shared.schemas import SLO_CLASSES, SloClass, slo_rank

ARRIVAL_HALF_LIFE_S = 10.0
EWMA_ALPHA = 0.1
MAX_RETRY_AFTER_S = 60.0


@dataclass(slots=True)
class Estimate:
    wait_s: float  # queueing before a worker takes it
    ttft_s: float  # the wait plus the mean worker-side TTFT
    rate: float  # requests/s left to the class


@dataclass(slots=True)
class LoadShedder:
    targets: SloTargets
    enabled: bool = True
    min_samples: int = 16
    margin: float = 0.8  # admit while the predicted TTFT is within this share of the target
    service_s: float = 0.0  # EWMA of dispatch -> end
    worker_ttft_s: float = 0.0  # EWMA of the worker's own time to first token
    samples: int = 0
    arrivals: DecayedRate = field(default_factory=lambda: DecayedRate(ARRIVAL_HALF_LIFE_S))

    def ended(self, service_s: float, worker_ttft_s: float) -> None:
        """A dispatched request ended after ``service_s`` (its worker's TTFT ``worker_ttft_s``)."""
        if self.samples == 0:
            self.service_s, self.worker_ttft_s = service_s, worker_ttft_s
        else:
            self.service_s += EWMA_ALPHA * (service_s - self.service_s)
            self.worker_ttft_s += EWMA_ALPHA * (worker_ttft_s - self.worker_ttft_s)
        self.samples += 1

    def admitted(self, slo_class: SloClass, now: float) -> None:
        self.arrivals.bump(slo_class, now)

    def rate(self, running: int) -> float | None:
        """Requests/s the fleet serves for this scheduler (None: not measured yet)."""
        if self.samples < self.min_samples or self.service_s <= 0 or running <= 0:
            return None
        return running / self.service_s

    def estimate(
        self, slo_class: SloClass, ahead: int, free: int, running: int, now: float, waited_s: float = 0.0
    ) -> Estimate | None:
        mu = self.rate(running)
        if mu is None:
            return None
        metrics.SCHEDULER_SERVICE_RATE.set(mu)
        above = sum(self.arrivals.rate(c, now) for c in SLO_CLASSES[: slo_rank(slo_class)])
        left = mu - above
        if ahead < free:
            wait = 0.0
        elif left <= 0:
            wait = float("inf")
        else:
            wait = (ahead + 1) / left
        return Estimate(wait, waited_s + wait + self.worker_ttft_s, max(left, 0.0))

    def check(
        self,
        slo_class: SloClass,
        ahead: int,
        free: int,
        running: int,
        now: float,
        waited_s: float = 0.0,
        patience_s: float | None = None,
    ) -> None:
        """Raise ``Overloaded`` when a request of ``slo_class`` would miss its TTFT target (``waited_s``:
        how long it already waited to be admitted, since the work queue stored it; ``patience_s``: how
        much longer its client waits for a worker to take it, its accept deadline: a tighter bound
        than a long class target, since a request still queued then is answered 503 anyway)."""
        est = self.estimate(slo_class, ahead, free, running, now, waited_s)
        if est is None or est.wait_s == 0:  # it will not queue: refusing it would spare nobody any wait
            return
        metrics.SCHEDULER_PREDICTED_TTFT.labels(slo_class).set(min(est.ttft_s, 1e6) * 1000)
        target = self.targets.of(slo_class)
        if patience_s is not None:
            target = min(target, waited_s + max(0.0, patience_s))
        if not self.enabled or est.ttft_s <= self.margin * target:
            return
        metrics.SCHEDULER_SHED.labels(slo_class).inc()
        # by then the queue ahead has drained to what the target allows; when higher classes take all
        # the capacity, look again after one target
        retry = est.ttft_s - self.margin * target if est.rate > 0 else target
        raise Overloaded(
            f"the fleet is overloaded for {slo_class} requests: predicted time to first token "
            f"{_seconds(est.ttft_s)} leaves no margin within its bound {target:.1f}s (the class's target, "
            "or the client's accept deadline if sooner)",
            retry_after_s=min(MAX_RETRY_AFTER_S, max(1.0, retry)),
        )


def _seconds(value: float) -> str:
    return "unbounded" if value == float("inf") else f"{value:.1f}s"
