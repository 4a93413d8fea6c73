"""The registry's settings: intake, release policy and remote adapter sources (``LF_*``); docs/settings.md lists every variable."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.config import CommonSettings, DefaultQuota


class RemoteSourceSettings(BaseModel):
    """How the registry fetches a register request's remote ``source_uri``: both kinds are off
    until enabled, and every fetch is bounded by these limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    s3_enabled: bool = Field(default=False, description="admit s3://bucket/prefix/ sources on the allow-list")
    https_enabled: bool = Field(default=False, description="admit https:// sources on the allow-list")
    max_total_bytes: int = Field(
        default=320 * 1_048_576, ge=1024, le=16 * 1024**3, description="bytes one fetch may read, all files together"
    )
    max_file_bytes: int = Field(
        default=256 * 1_048_576, ge=1024, le=8 * 1024**3, description="bytes of any one fetched file"
    )
    max_files: int = Field(default=2, ge=2, le=64, description="objects an s3 prefix may list (only the two are read)")
    timeout_s: float = Field(default=120.0, gt=0, le=3600, description="bound of one whole fetch, every file included")
    max_redirects: int = Field(
        default=3, ge=0, le=10, description="redirects followed per file, each to an allow-listed URL only"
    )
    ca_file: str | None = Field(
        default=None, description="PEM bundle of the CAs TLS is verified against; None = the system's (certifi)"
    )
    s3_endpoint_url: str = Field(
        default="https://s3.amazonaws.com",
        pattern=r"^https?://[^/?#@]+/?$",
        description="S3-compatible endpoint (path-style requests); credentials come from the AWS chain",
    )
    s3_region: str = Field(
        default="us-east-1", pattern=r"^[a-z0-9-]{1,32}$", description="region requests are signed for"
    )
    max_fetches: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="fetches this registry replica runs at once, all tenants together; one more is refused 503 "
        "with Retry-After, never queued",
    )
    max_tenant_fetches: int = Field(
        default=2, ge=1, le=1024, description="fetches one tenant runs at once on a replica; one more is refused 429"
    )
    spool_bytes: int = Field(
        default=1280 * 1_048_576,
        ge=1024,
        le=1024**4,
        description="bytes the fetches in flight on a replica may hold on its disk, all tenants together; a fetch "
        "that would pass it is stopped and refused 507",
    )
    tenant_spool_bytes: int = Field(
        default=640 * 1_048_576,
        ge=1024,
        le=1024**4,
        description="bytes one tenant's fetches in flight may hold on a replica's disk; at least max_total_bytes",
    )
    spool_dir: str | None = Field(
        default=None, description="where fetched files are spooled until admitted; None = the system's temp dir"
    )

    @model_validator(mode="after")
    def _one_fetch_fits_its_quotas(self) -> "RemoteSourceSettings":
        if not self.max_total_bytes <= self.tenant_spool_bytes <= self.spool_bytes:
            raise ValueError("max_total_bytes <= tenant_spool_bytes <= spool_bytes: one fetch must fit either quota")
        if self.max_tenant_fetches > self.max_fetches:
            raise ValueError("max_tenant_fetches <= max_fetches")
        return self


class RegistrySettings(CommonSettings):
    model_dir: str | None = Field(default=None, description="base model directory; None = embedded SmolLM2")
    model_cache: str | None = Field(default=None, description="where the embedded GGUF is converted once")
    dev_mode: bool = Field(default=False, description="admit unsigned adapters; never in production")
    max_rank: int = Field(default=64, ge=1, le=1024, description="largest LoRA rank admitted")
    fleet_rank_classes: tuple[int, ...] = Field(
        default=(8, 16, 32, 64),
        min_length=1,
        max_length=16,
        description="the fleet's rank classes while no worker of the base model is live (JSON list); with live "
        "workers, the classes their heartbeats announce: a push whose rank none holds is refused",
    )
    fleet_slot_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="the workers' slot dtype (their LF_ENGINE__DTYPE): sizes the recorded slot bytes"
    )
    max_adapter_bytes: int = Field(
        default=256 * 1_048_576, ge=1024, le=8 * 1024**3, description="largest adapter_model.safetensors admitted"
    )
    store_dir: str | None = Field(
        default=None, description="approved store as a local trusted directory; None = the JetStream object store"
    )
    trusted_source_dirs: tuple[str, ...] = Field(
        default=(), description="directories a register request may name as a file:// source"
    )
    remote: RemoteSourceSettings = Field(
        default_factory=lambda: RemoteSourceSettings(),
        description="remote adapter sources (s3://, https://), off by default (LF_REMOTE__*); the allow-list of "
        "prefixes lives in the registry (lorafleet source add)",
    )
    default_quota: DefaultQuota = Field(
        default_factory=DefaultQuota,
        description="every tenant's limits where its own quota leaves them unset, as the scheduler's "
        "(LF_DEFAULT_QUOTA__<FIELD>): pins are held to its GPU adapter slots",
    )
    release_require_eval: bool = Field(
        default=True,
        description="refuse to promote a version without an eval set, unless a platform admin skips the eval "
        "(off: /readyz and the dashboard say so; a version with an eval set is always gated on its platform-run score)",
    )
    release_eval_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="how long the release gate waits for each eval item's answer from a worker",
    )
    release_min_score: float = Field(default=0.0, ge=0, le=1, description="floor under every eval set's own threshold")
    release_max_regression: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="how far a candidate's platform-run score may fall below production's on the same eval set",
    )
    release_steps: tuple[float, ...] = Field(
        default=(1.0, 10.0, 50.0, 100.0), min_length=1, description="the controller's canary traffic shares, percent"
    )
    release_gate: bool = Field(
        default=True, description="the controller refuses a rollout whose version has no passing platform-run eval"
    )
    release_min_samples: int = Field(
        default=200, ge=1, le=1_000_000, description="completions of each version a step needs before advancing"
    )
    release_dwell_s: float = Field(default=300.0, ge=0, le=86_400, description="shortest time a step lasts")
    release_guard_min_samples: int = Field(
        default=20, ge=1, le=1_000_000, description="canary completions before the guards judge it"
    )
    release_max_error_increase: float = Field(
        default=0.02, ge=0, le=1, description="canary error rate above production's that rolls back"
    )
    release_max_latency_ratio: float = Field(
        default=1.5, ge=1, le=100, description="canary TTFT/TPOT p50 or p95 over production's that rolls back"
    )
    release_latency_slack_ms: float = Field(
        default=5.0, ge=0, le=60_000, description="a latency difference under this never trips the ratio guard"
    )
    release_max_cost_ratio: float = Field(
        default=1.5, ge=1, le=100, description="canary engine time per output token over production's that rolls back"
    )
    release_max_complaint_increase: float = Field(
        default=0.05, ge=0, le=1, description="canary complaint rate above production's that rolls back"
    )
    release_min_complaint_tenants: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="distinct tenants whose complaints it takes to roll back a shared adapter's version",
    )
    release_max_tenant_complaint_share: float = Field(
        default=0.1,
        gt=0,
        le=1,
        description="of a shared version's completions in a step, the most one tenant's complaints count for",
    )
    release_min_shadow_pairs: int = Field(
        default=50,
        ge=1,
        le=1_000_000,
        description="production requests the canary answered in the shadow (paired) before the agreement guard judges",
    )
    release_min_agreement: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="share of the canary's shadow answers equal to production's below which it is rolled back "
        "(0: the agreement is shown and exported, not judged; a version meant to answer differently disagrees)",
    )
    release_tick_s: float = Field(default=1.0, gt=0, le=60, description="how often the controller judges each rollout")
    release_lease_s: float = Field(
        default=10.0, gt=0, le=600, description="a rollout whose driving replica is silent this long is taken over"
    )
    gateway_sync_timeout_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="how long a catalog write waits for every live catalog mirror (gateways, schedulers, "
        "workers) to hold it (0 = no wait); keep it under the gateways' registry_timeout_s, which bounds "
        "their admin calls",
    )

    @field_validator("fleet_rank_classes")
    @classmethod
    def _ascending_classes(cls, ranks: tuple[int, ...]) -> tuple[int, ...]:
        if any(r < 1 or r > 1024 for r in ranks) or list(ranks) != sorted(set(ranks)):
            raise ValueError("strictly ascending ranks in [1, 1024]")
        return ranks

    @field_validator("release_steps")
    @classmethod
    def _steps_rise_to_all_traffic(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if any(not 0 < s <= 100 for s in steps) or list(steps) != sorted(set(steps)) or steps[-1] != 100:
            raise ValueError("increasing traffic percentages in (0, 100], the last one 100")
        return steps
