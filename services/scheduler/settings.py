"""The scheduler's settings (``LF_*``); docs/settings.md lists every variable."""

from pydantic import Field

from shared.config import DefaultQuota, RequestBounds, SloTargets


class SchedulerSettings(RequestBounds):
    dispatch_timeout_s: float = Field(default=2.0, gt=0, le=60, description="bound of one dispatch to a worker")
    no_worker_grace_s: float = Field(
        default=3.0, ge=0, le=300, description="how long a request may wait for a live worker before a 503"
    )
    max_inflight: int = Field(default=256, ge=1, le=100_000, description="submissions held in the scheduler's queue")
    intake_per_tenant: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="submissions of one tenant fetched but not yet admitted; beyond it the tenant's are refused (429)",
    )
    default_quota: DefaultQuota = Field(
        default_factory=DefaultQuota,
        description="limits of every tenant whose own quota leaves them unset (LF_DEFAULT_QUOTA__<FIELD>)",
    )
    concurrency_lease_s: float = Field(
        default=60.0, gt=0, le=3600, description="a concurrency slot nobody renews frees itself after this long"
    )
    vtc_input_weight: float = Field(default=1.0, ge=0, le=100, description="fairness charge per prompt token")
    vtc_output_weight: float = Field(default=2.0, ge=0, le=100, description="fairness charge per generated token")
    vtc_hand_off_s: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="how often the fairness counters are handed to and read from Redis (shared by every "
        "scheduler): how far behind the other schedulers' charges one scheduler's fair order may be",
    )
    slo_ttft_s: SloTargets = Field(
        default_factory=lambda: SloTargets(),
        description="time-to-first-token target of each SLO class (LF_SLO_TTFT_S__<CLASS>)",
    )
    shed_overload: bool = Field(
        default=True,
        description="refuse at once (429 overloaded + Retry-After) a request the fleet's measured service rate "
        "says would miss its class's TTFT target, instead of queueing it to miss it",
    )
    shed_min_samples: int = Field(
        default=16, ge=1, le=100_000, description="completed requests measured before shedding starts"
    )
    shed_margin: float = Field(
        default=0.8, gt=0, le=1, description="admit while the predicted TTFT is within this share of the target"
    )
    capacity_headroom: int = Field(
        default=2, ge=0, le=10_000, description="requests a worker may hold beyond max_running (its next batch)"
    )
    heat_half_life_s: float = Field(default=60.0, gt=0, le=86400, description="half-life of adapter heat")
    heat_decay_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="how often heat decays and is acted on"
    )
    hot_rate_per_worker: float = Field(
        default=2.0, gt=0, description="requests/s of one adapter one worker serves before a replica is prefetched"
    )
    cold_rate: float = Field(default=0.01, ge=0, description="requests/s below which a replicated adapter is evicted")
    max_controls_per_tick: int = Field(default=4, ge=0, le=1000, description="prefetch/evict messages per heat tick")
    dedupe_ttl_s: float = Field(default=3600.0, gt=0, description="how long a dispatched request id is remembered")
    shadow_sample: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="share of the greedy requests an adapter's production version serves, while a canary of it "
        "is out, that the canary answers too in the shadow (off the client's path; 0: no shadow evaluation)",
    )
    shadow_max_tokens: int = Field(
        default=64, ge=1, le=32_768, description="output tokens a shadow run generates and compares at most"
    )
    shadow_max_inflight: int = Field(
        default=8,
        ge=0,
        le=10_000,
        description="shadow runs held or running at once; past it a sampled request goes unshadowed",
    )
