"""The release controller's rollouts: their state in KV, the figures each decision was based on,
and the registry ops that start one and show them."""

import time
from typing import Literal

from pydantic import Field, model_validator

from shared.schemas.base import Identifier, Message
from shared.schemas.registry import Actor

ReleasePhase = Literal["running", "released", "rolled_back", "gate_failed", "superseded"]
DecisionAction = Literal["started", "advanced", "rolled_back", "released", "gate_failed", "superseded"]
MAX_DECISIONS = 64  # kept per rollout in its KV record; every one is also on the audit trail


class VersionFigures(Message):
    """One version's live traffic over the current step's window, from the AUDIT stream."""

    version: int = Field(ge=1)
    samples: int = Field(ge=0, description="completions (cancelled ones excluded)")
    errors: int = Field(ge=0)
    error_rate: float = Field(ge=0, le=1)
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p95_ms: float | None = None
    tokens_per_request: float | None = Field(default=None, description="prompt + completion tokens (shown, not judged)")
    engine_ms_per_token: float | None = Field(
        default=None,
        ge=0,
        description="cost: engine time charged to its completions over their output tokens, of the completions "
        "whose worker measured it (None: none did, e.g. on vLLM workers)",
    )
    feedback: int = Field(default=0, ge=0, description="rated requests")
    complaints: int = Field(
        default=0, ge=0, description="requests rated down (a shared version's: each tenant's bounded)"
    )
    complaining_tenants: int = Field(default=0, ge=0, description="distinct tenants that rated a request down")
    complaint_rate: float = Field(default=0.0, ge=0, le=1, description="complaints per completion")
    shadow_pairs: int = Field(
        default=0, ge=0, description="production requests this version also answered in the shadow, paired by id"
    )
    agreement_rate: float | None = Field(
        default=None, ge=0, le=1, description="share of the pairs whose two answers are the same tokens"
    )
    prefix_agreement: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="mean share of the longer answer both agree on from the start (a lower bound, per pair)",
    )


class ReleaseDecision(Message):
    ts: float = Field(default_factory=time.time)
    action: DecisionAction
    percent: float = Field(ge=0, le=100, description="the canary's traffic share after the decision")
    reasons: list[str] = Field(default_factory=list)
    canary: VersionFigures | None = None
    baseline: VersionFigures | None = None


class ReleaseState(Message):
    """One rollout as the controller drives it; the KV revision of this record is its lease."""

    adapter_id: Identifier
    tenant_id: Identifier
    version: int = Field(ge=1)
    baseline_version: int | None = Field(default=None, description="the production version compared against")
    steps: list[float] = Field(min_length=1)
    step: int = Field(default=0, ge=0, description="index into steps of the current traffic share")
    phase: ReleasePhase = "running"
    actor: Actor
    started_at: float = Field(default_factory=time.time)
    step_started_at: float = Field(default_factory=time.time)
    owner: str | None = Field(default=None, description="the registry instance driving it")
    lease_until: float = 0.0
    figures: list[VersionFigures] = Field(default_factory=list, description="canary, then baseline, at the last tick")
    decisions: list[ReleaseDecision] = Field(default_factory=list, max_length=MAX_DECISIONS)

    @property
    def percent(self) -> float:
        return self.steps[self.step]


class ReleaseStartRequest(Message):
    """Start a controlled rollout of a staging version: eval gate, then the configured steps."""

    adapter_id: Identifier
    version: int = Field(ge=1)
    skip_eval: bool = Field(
        default=False, description="skip the platform-run eval gate: a platform admin's only, audited with the reason"
    )
    reason: str | None = Field(default=None, max_length=500)
    actor: Actor

    @model_validator(mode="after")
    def _skip_has_reason(self) -> "ReleaseStartRequest":
        if self.skip_eval and not self.reason:
            raise ValueError("skip_eval needs a reason (it is audited)")
        return self


class ReleaseStatusRequest(Message):
    adapter_id: Identifier | None = Field(default=None, description="None: every rollout")


class ReleaseStatusReply(Message):
    releases: list[ReleaseState] = Field(default_factory=list)
