"""Prometheus metric families, defined once; each service exports the ones it records."""

import contextlib
import threading
import time
from collections.abc import Callable

import structlog
from prometheus_client import Counter, Gauge, Histogram

from shared.decay import DecayedRate

log = structlog.get_logger("metrics")

_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)

# the brief's eight categories
ADAPTER_CACHE_LOOKUPS = Counter(
    "adapter_cache_lookups", "adapter lookups by the tier that answered", ["tier"]
)  # gpu | cpu | miss
ADAPTER_CACHE_HIT_RATIO = Gauge("adapter_cache_hit_ratio", "share of lookups answered by each tier", ["tier"])
ADAPTER_LOAD_LATENCY = Histogram("adapter_load_latency_ms", "adapter load time by source tier", ["source"], buckets=_MS)
TTFT = Histogram("ttft_ms", "time to first token", ["cache_hit"], buckets=_MS)
TPOT = Histogram(
    "tpot_ms",
    "time per output token after the first",
    ["cache_hit"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
ADAPTER_TOKENS = Counter(
    "adapter_tokens", "generated tokens per adapter (the top N adapters by traffic, the rest as other)", ["adapter"]
)
ADAPTER_TTFT = Histogram(
    "adapter_ttft_ms",
    "time to first token per adapter (the top N adapters by traffic, the rest as other)",
    ["adapter"],
    buckets=_MS,
)
ADAPTER_TPOT = Histogram(
    "adapter_tpot_ms",
    "time per output token per adapter (the top N adapters by traffic, the rest as other)",
    ["adapter"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
ADAPTER_ENGINE_SECONDS = Counter(
    "adapter_engine_seconds",
    "engine step time charged to each adapter's requests by their token share of each step (the top N adapters by "
    "traffic, the rest as other; the built-in engine only)",
    ["adapter"],
)
ADAPTER_ENGINE_TOKENS = Counter(
    "adapter_engine_output_tokens",
    "output tokens of the requests adapter_engine_seconds charged: its rate over this one's is engine time per "
    "output token",
    ["adapter"],
)
RANK_CLASS_TTFT = Histogram(
    "rank_class_ttft_ms",
    "time to first token by the adapter's rank class on the worker (base: no adapter)",
    ["rank_class"],
    buckets=_MS,
)
RANK_CLASS_TPOT = Histogram(
    "rank_class_tpot_ms",
    "time per output token after the first by the adapter's rank class on the worker (base: no adapter)",
    ["rank_class"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
SLO_TTFT = Histogram(
    "slo_ttft_ms",
    "time to first token by SLO class, from the scheduler's admission (InferRequest.created_at) to the first token",
    ["slo_class"],
    buckets=_MS,
)
SLO_TPOT = Histogram(
    "slo_tpot_ms",
    "time per output token after the first, by SLO class",
    ["slo_class"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
SLO_REQUESTS = Counter(
    "slo_requests",
    "requests with a TTFT target, by SLO class and whether their first token came within it (met, missed)",
    ["slo_class", "outcome"],
)
SLO_ATTAINMENT = Gauge(
    "slo_attainment_ratio", "share of the class's most recent requests with a TTFT target that met it", ["slo_class"]
)
ADAPTER_EVICTIONS = Counter("adapter_evictions", "adapters evicted from a tier", ["tier", "reason"])
ADAPTER_QUOTA_WAITS = Counter(
    "adapter_quota_waits", "adapter loads that waited for one of their tenant's own slots (hard slot quota)"
)
STEP_TIME = Histogram("engine_step_time_ms", "engine step time by the step's rank mix", ["rank_mix"], buckets=_MS)
RANK_SKEW = Gauge(
    "engine_rank_skew_ratio",
    "mean step time of steps whose highest rank class is rank_class (above the worker's lowest) over the mean "
    "step time of steps reading only the lowest rank class, both among steps of batch_tokens tokens (the "
    "step's token count rounded up to a power of two); running means since start, set once both are seen",
    ["rank_class", "batch_tokens"],
)
TENANT_ISOLATION_ERRORS = Counter(
    "tenant_isolation_errors",
    "cross-tenant attempts refused (a tenant naming another's adapter), by the route that refused them "
    "(http: the gateway's resolve, nats: a direct-NATS submission, dispatch: a worker's check); counted by the auditor",
    ["route"],
)
TENANT_ISOLATION_VIOLATIONS = Counter(
    "tenant_isolation_violations",
    "completions the auditor's cross-check found served across tenants (after the fact; should stay 0)",
)
INTEGRITY_ERRORS = Counter("integrity_errors", "adapter digest/signature/fingerprint mismatches", ["service"])
QUALITY_SCORE = Gauge("adapter_quality_score", "latest evaluation score", ["adapter", "version"])
SHADOW_RUNS = Counter(
    "shadow_runs",
    "canary runs of sampled production requests (shadow evaluation), by fate: dispatched, skipped (too many "
    "shadow runs held or running) or dropped (refused, or no worker in time)",
    ["fate"],
)
SHADOW_PAIRS = Counter(
    "shadow_pairs",
    "production answers paired with the canary's shadow answer to the same request, by whether they agree "
    "(the same output tokens)",
    ["adapter", "canary_version", "production_version", "agree"],
)
SHADOW_AGREEMENT = Gauge(
    "shadow_agreement_ratio",
    "the canary's shadow answers equal to production's over the rollout step's window, and the mean shared "
    "prefix share (measure: exact, prefix)",
    ["adapter", "canary_version", "production_version", "measure"],
)
QUALITY_REGRESSION = Gauge(
    "quality_regression",
    "canary minus production on the same items: shadow agreement (exact, prefix: production agrees with "
    "itself, so 0 is no change) and the platform-run eval score (eval_score), per rollout",
    ["adapter", "canary_version", "production_version", "measure"],
)

# operations
REQUESTS = Counter("requests", "requests by service and outcome", ["service", "outcome"])
ROUTED_REQUESTS = Counter(
    "routed_requests",
    "requests a task route or a routing policy decided, by the path that evaluated them (http: gateway, "
    "nats: scheduler), task (the top 50, the rest as other; none: no task) and outcome (task, rule, or the "
    "refusal's error code)",
    ["route", "task", "outcome"],
)
EXPERIMENT_REQUESTS = Counter(
    "experiment_requests",
    "requests routed to an experiment, by the path that assigned them (http: gateway, nats: scheduler), "
    "experiment (<tenant>/<name>, the top 50, the rest as other) and arm",
    ["route", "experiment", "arm"],
)
GATEWAY_RESOLVES = Counter(
    "gateway_resolves",
    "model resolutions by where they were answered: the gateway's catalog mirror or the registry",
    ["source"],
)
UNDECODABLE = Counter(
    "undecodable_messages",
    "bucket entries and stream messages skipped because they could not be decoded, by bucket or stream",
    ["source"],
)
KV_WATCH_RESTARTS = Counter(
    "kv_watch_restarts", "mirror watches started over (failed, or stalled behind the bucket)", ["bucket"]
)
GATEWAY_SYNC_TIMEOUTS = Counter(
    "gateway_sync_timeouts",
    "catalog writes that a live catalog mirror (gateway, scheduler, worker) did not confirm in time",
)
ADMISSION_REJECTIONS = Counter("admission_rejections", "requests refused before running", ["reason"])
QUEUE_DEPTH = Gauge("queue_depth", "requests waiting", ["service"])
RUNNING = Gauge("running_requests", "requests running in the engine")
KV_USAGE = Gauge("kv_cache_usage_ratio", "share of KV blocks in use")
PREFIX_QUERIED_TOKENS = Counter("prefix_cache_queried_tokens", "prompt tokens looked up in the engine's prefix cache")
PREFIX_HIT_TOKENS = Counter("prefix_cache_hit_tokens", "prompt tokens whose K/V came from the prefix cache")
SLOT_OCCUPANCY = Gauge("adapter_slot_occupancy_ratio", "share of GPU adapter slots in use", ["rank_class"])
ADAPTER_SLOT_WAIT = Histogram(
    "adapter_slot_wait_ms", "time a load waited for a slot held by requests in flight", buckets=_MS
)
ADAPTER_CPU_TIER_BYTES = Gauge("adapter_cpu_tier_bytes", "bytes of verified adapter weights in the CPU tier")
SCHEDULER_QUEUE_WAIT = Histogram(
    "scheduler_queue_wait_ms", "time a request waited in the scheduler's fair queue", ["priority"], buckets=_MS
)
SLO_MISSES = Counter(
    "scheduler_slo_misses", "requests that waited in the queue past their class's TTFT target", ["priority"]
)
SCHEDULER_SHED = Counter(
    "scheduler_shed",
    "requests refused at admission (429 overloaded): they would have missed their class's TTFT target",
    ["slo_class"],
)
SCHEDULER_PREDICTED_TTFT = Gauge(
    "scheduler_predicted_ttft_ms", "the last admission's predicted time to first token, by SLO class", ["slo_class"]
)
SCHEDULER_SERVICE_RATE = Gauge(
    "scheduler_service_rate",
    "requests/s the fleet serves for this scheduler (Little's law: running / mean service time)",
)
WORKERS_LOST = Counter("workers_lost", "workers dropped for silence, with requests failed over", ["outcome"])
SCHEDULER_CONTROLS = Counter("scheduler_controls", "prefetch/evict directives sent to workers", ["action"])
SCHEDULER_DISPATCHES = Counter("scheduler_dispatches", "requests a worker accepted from this scheduler", ["worker"])
SCHEDULER_WORKER_INFLIGHT = Gauge(
    "scheduler_worker_inflight", "requests this scheduler placed on a worker that have not ended", ["worker"]
)
RANK_SPILLS = Counter(
    "scheduler_rank_spills",
    "requests of a rank class a worker pool serves placed outside that pool (every pool worker saturated)",
    ["rank_class"],
)
GRAMMAR_COMPILES = Counter(
    "grammar_compiles",
    "a worker's grammar compiles (response_format, tools) by outcome: compiled, invalid, too_complex (killed at "
    "the time bound), busy (no turn or compiler within it), refused_again (a tenant's refused grammar, from its cache)",
    ["outcome"],
)
REDIS_FALLBACKS = Counter("redis_fallbacks", "operations that fell back because Redis was unavailable", ["op"])


class TopLabels:
    """Keeps a label's cardinality bounded to the ``limit`` values with the most traffic, the rest
    reading ``other``.

    Traffic is a decayed request rate (half-life ``half_life_s``). Until ``limit`` values are seen each
    new one gets its own series. Every ``rerank_s`` the top ``limit`` by rate are chosen again: a value
    that leaves the top has its series removed from ``families`` (Prometheus marks them stale), and its
    later traffic reads ``other``. A value that enters the top starts a series of its own from then on."""

    def __init__(
        self,
        limit: int,
        families: tuple[Counter | Histogram | Gauge, ...] = (),
        half_life_s: float = 300.0,
        rerank_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limit = limit
        self.families = families
        self.rerank_s = rerank_s
        self._clock = clock
        self._rate = DecayedRate(half_life_s)
        self._top: set[str] = set()
        self._ranked_at = clock()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        with self._lock:
            now = self._clock()
            self._rate.bump(value, now)
            if now - self._ranked_at >= self.rerank_s:
                self._rerank(now)
            if value in self._top:
                return value
            if len(self._top) < self.limit:
                self._top.add(value)
                return value
        return "other"

    def top(self) -> set[str]:
        with self._lock:
            return set(self._top)

    def _rerank(self, now: float) -> None:
        self._ranked_at = now
        rates = self._rate.snapshot(now)
        ranked = sorted(rates, key=lambda v: (-rates[v], v))[: self.limit]
        keep = set(ranked)
        for gone in self._top - keep:
            for family in self.families:
                with contextlib.suppress(KeyError):
                    family.remove(gone)
        self._top = keep
