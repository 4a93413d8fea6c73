"""Live traffic of the adapters under rollout, per version, from their completion and feedback
audit records: the figures the release controller compares."""

import math
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared import metrics
from shared.answer_digest import agreement
from shared.schemas import AnswerDigest, CompletionAudit, FeedbackAudit, VersionFigures

MAX_SAMPLES = 50_000  # per version: a step's window past this keeps its newest completions
MAX_UNPAIRED = 10_000  # answers waiting for their other half (a lost record leaves one waiting for ever)


@dataclass(frozen=True, slots=True)
class Sample:
    ts: float
    error: bool
    ttft_ms: float
    tpot_ms: float
    tokens: int
    completion_tokens: int
    engine_s: float | None  # None: its worker's engine does not measure it (vLLM), or an older worker

    @classmethod
    def of(cls, record: CompletionAudit) -> "Sample":
        return cls(
            record.ts,
            record.outcome == "error",
            record.ttft_ms,
            record.tpot_ms,
            record.prompt_tokens + record.completion_tokens,
            record.completion_tokens,
            record.engine_s,
        )


@dataclass(frozen=True, slots=True)
class Pair:
    """A production answer and the canary's shadow answer to the same request, compared."""

    ts: float
    production_version: int
    exact: bool
    prefix: float


@dataclass(frozen=True, slots=True)
class Half:
    """One side of a pair, waiting for the other: (version, answer, ts)."""

    version: int
    answer: AnswerDigest
    ts: float


@dataclass(slots=True)
class VersionTraffic:
    samples: deque[Sample] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    pairs: deque[Pair] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))  # this version in the shadow
    # (tenant, request id) -> (ts, complaint): request ids are per tenant, so are ratings
    ratings: dict[tuple[str, str], tuple[float, bool]] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (inclusive method), None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def engine_ms_per_token(served: list[Sample]) -> float | None:
    """The version's cost: engine time over output tokens, of the completions whose worker measured
    it; None while none did (never a figure made up for an engine that does not measure)."""
    measured = [s for s in served if s.engine_s is not None]
    tokens = sum(s.completion_tokens for s in measured)
    if not tokens:
        return None
    return sum(s.engine_s or 0.0 for s in measured) * 1000 / tokens


class LiveStats:
    """Completions and ratings of the watched adapters; everything else is dropped on arrival."""

    def __init__(self) -> None:
        self._traffic: dict[tuple[str, int], VersionTraffic] = {}
        self._watched: frozenset[str] = frozenset()
        # (adapter, tenant, production request id) -> the answer that came first, production's or the shadow's
        self._production: OrderedDict[tuple[str, str, str], Half] = OrderedDict()
        self._shadow: OrderedDict[tuple[str, str, str], Half] = OrderedDict()

    def watch(self, adapter_ids: Iterable[str]) -> None:
        """Keep the records of exactly these adapters from now on; forget the others'."""
        self._watched = frozenset(adapter_ids)
        for key in [k for k in self._traffic if k[0] not in self._watched]:
            del self._traffic[key]
        for halves in (self._production, self._shadow):
            for half in [k for k in halves if k[0] not in self._watched]:
                del halves[half]

    def also_watch(self, adapter_id: str) -> None:
        self._watched = self._watched | {adapter_id}

    def _of(self, adapter_id: str | None, version: int | None) -> VersionTraffic | None:
        if adapter_id is None or version is None or adapter_id not in self._watched:
            return None
        return self._traffic.setdefault((adapter_id, version), VersionTraffic())

    def add_completion(self, record: CompletionAudit) -> None:
        traffic = self._of(record.adapter_id, record.adapter_version)
        if traffic is None or record.outcome == "cancelled":  # a client that left says nothing of the version
            return
        if record.answer is not None:
            self._pair(record, record.answer)
        if record.shadow_of is not None:  # the canary's run of another version's request: served to no one
            return
        traffic.samples.append(Sample.of(record))

    def _pair(self, record: CompletionAudit, answer: AnswerDigest) -> None:
        """Keep one half of a shadow pair, or, its other half here, compare the two and keep the pair
        under the canary's version. Request ids are per tenant: so are pairs."""
        assert record.adapter_id is not None and record.adapter_version is not None
        shadow = record.shadow_of is not None
        key = (record.adapter_id, record.tenant_id, record.shadow_of or record.request_id)
        mine, theirs = (self._shadow, self._production) if shadow else (self._production, self._shadow)
        other = theirs.pop(key, None)
        half = Half(record.adapter_version, answer, record.ts)
        if other is None:
            mine[key] = half
            while len(mine) > MAX_UNPAIRED:
                mine.popitem(last=False)
            return
        canary, production = (half, other) if shadow else (other, half)
        exact, prefix = agreement(production.answer, canary.answer)
        traffic = self._of(record.adapter_id, canary.version)
        assert traffic is not None, "the record's adapter is watched"
        traffic.pairs.append(Pair(max(half.ts, other.ts), production.version, exact, prefix))
        labels = (record.adapter_id, str(canary.version), str(production.version), "true" if exact else "false")
        metrics.SHADOW_PAIRS.labels(*labels).inc()

    def add_feedback(self, record: FeedbackAudit) -> None:
        """One rating per request of a tenant: a later one of that tenant replaces it; another
        tenant's request under the same id is another request."""
        traffic = self._of(record.adapter_id, record.adapter_version)
        if traffic is not None:
            traffic.ratings[(record.tenant_id, record.request_id)] = (record.ts, record.rating == "down")

    def forget_before(self, adapter_id: str, ts: float) -> None:
        """Drop the adapter's records older than ``ts`` (a step's window has moved past them)."""
        for (adapter, _), traffic in self._traffic.items():
            if adapter != adapter_id:
                continue
            while traffic.samples and traffic.samples[0].ts < ts:
                traffic.samples.popleft()
            while traffic.pairs and traffic.pairs[0].ts < ts:
                traffic.pairs.popleft()
            traffic.ratings = {r: v for r, v in traffic.ratings.items() if v[0] >= ts}

    def figures(self, adapter_id: str, version: int, since: float, tenant_share: float | None = None) -> VersionFigures:
        """The version's figures over records from ``since`` on. ``tenant_share`` (a shared version's)
        bounds each tenant's weight: its complaints count up to that share of the window's
        completions (at least one), so one tenant alone cannot make the version's complaint rate."""
        traffic = self._traffic.get((adapter_id, version), VersionTraffic())
        window = [s for s in traffic.samples if s.ts >= since]
        served = [s for s in window if not s.error]
        ttft = [s.ttft_ms for s in served]
        tpot = [s.tpot_ms for s in served]
        errors = len(window) - len(served)
        rated = {key: complaint for key, (ts, complaint) in traffic.ratings.items() if ts >= since}
        by_tenant = Counter(tenant for (tenant, _), complaint in rated.items() if complaint)
        cap = None if tenant_share is None else max(1, math.floor(tenant_share * len(window)))
        complaints = sum(n if cap is None else min(n, cap) for n in by_tenant.values())
        pairs = [p for p in traffic.pairs if p.ts >= since]
        return VersionFigures(
            version=version,
            samples=len(window),
            errors=errors,
            error_rate=errors / len(window) if window else 0.0,
            ttft_p50_ms=percentile(ttft, 50),
            ttft_p95_ms=percentile(ttft, 95),
            tpot_p50_ms=percentile(tpot, 50),
            tpot_p95_ms=percentile(tpot, 95),
            tokens_per_request=statistics.fmean(s.tokens for s in served) if served else None,
            engine_ms_per_token=engine_ms_per_token(served),
            feedback=len(rated),
            complaints=complaints,
            complaining_tenants=len(by_tenant),
            complaint_rate=min(1.0, complaints / len(window)) if window else 0.0,
            shadow_pairs=len(pairs),
            agreement_rate=sum(p.exact for p in pairs) / len(pairs) if pairs else None,
            prefix_agreement=statistics.fmean(p.prefix for p in pairs) if pairs else None,
        )
