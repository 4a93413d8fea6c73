"""Experiments across adapters: N weighted arms (an adapter, a pinned version, or the base model)
that a tenant's requests are split over, sticky by (tenant, user), until the experiment is stopped
with a winner. Stored in the ``lf_routing`` KV bucket (``experiments.<tenant>.<name>``) with a
revision that every change increments; ``model: "experiment:<name>"`` or a policy rule's
``experiment`` target routes to one.
"""

import time
from typing import Literal

from pydantic import Field, model_validator

from shared.schemas.base import Identifier, Message
from shared.schemas.inference import TASK_PATTERN
from shared.schemas.registry import Actor
from shared.schemas.routing import RouteTarget

EXPERIMENT_PATTERN = TASK_PATTERN  # an experiment's name: lower-case, one subject/KV token
ARM_PATTERN = r"^[A-Za-z0-9_-]{1,32}$"
MIN_ARMS, MAX_ARMS = 2, 8
ExperimentState = Literal["running", "paused", "stopped"]


class ExperimentArm(Message):
    name: str = Field(pattern=ARM_PATTERN, description="the arm's label in audit records, metrics and figures")
    adapter: RouteTarget | None = Field(default=None, description="adapter or adapter@version; None: the base model")
    weight: int = Field(default=1, ge=1, le=10_000, description="its share of the traffic: weight over the arms' total")

    @property
    def target(self) -> str:
        return "base" if self.adapter is None else self.adapter.model


def check_arms(arms: list[ExperimentArm]) -> list[ExperimentArm]:
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError("arm names must be unique within an experiment")
    return arms


class Experiment(Message):
    """A running experiment splits by (tenant, user); a paused one serves its first arm (the control)
    to all; a stopped one serves its ``winner`` to all."""

    tenant_id: Identifier
    name: str = Field(pattern=EXPERIMENT_PATTERN)
    arms: list[ExperimentArm] = Field(min_length=MIN_ARMS, max_length=MAX_ARMS)
    state: ExperimentState = "running"
    winner: str | None = Field(default=None, pattern=ARM_PATTERN, description="set when stopped")
    started_at: float = Field(default_factory=time.time)
    revision: int = Field(default=0, ge=0, description="incremented by every change")
    updated_by: str = Field(default="", max_length=256)
    updated_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _consistent(self) -> "Experiment":
        names = [a.name for a in check_arms(self.arms)]
        if (self.state == "stopped") != (self.winner is not None):
            raise ValueError("a stopped experiment names its winner, and only a stopped one")
        if self.winner is not None and self.winner not in names:
            raise ValueError(f"the winner {self.winner!r} is not one of the arms")
        return self

    def arm(self, name: str) -> ExperimentArm:
        return next(a for a in self.arms if a.name == name)


# ---- registry ops ----------------------------------------------------------------------------


class CreateExperimentRequest(Message):
    """Create (and start) an experiment; an existing one of that name must be stopped to be replaced."""

    tenant_id: Identifier
    name: str = Field(pattern=EXPERIMENT_PATTERN)
    arms: list[ExperimentArm] = Field(min_length=MIN_ARMS, max_length=MAX_ARMS)
    actor: Actor

    @model_validator(mode="after")
    def _unique(self) -> "CreateExperimentRequest":
        check_arms(self.arms)
        return self


class ExperimentStateRequest(Message):
    tenant_id: Identifier
    name: str = Field(pattern=EXPERIMENT_PATTERN)
    state: ExperimentState = Field(description="paused: pause; running: resume; stopped: stop (with a winner)")
    winner: str | None = Field(default=None, pattern=ARM_PATTERN, description="required to stop")
    actor: Actor


class GetExperimentRequest(Message):
    tenant_id: Identifier
    name: str = Field(pattern=EXPERIMENT_PATTERN)


class ListExperimentsRequest(Message):
    tenant_id: Identifier


class ExperimentReply(Message):
    experiment: Experiment


class ExperimentsReply(Message):
    experiments: list[Experiment]


class Interval(Message):
    """A figure and its 95% confidence interval (None: no data to estimate it from)."""

    value: float | None = None
    low: float | None = None
    high: float | None = None


class ArmFigures(Message):
    """One arm's served traffic since the experiment started, from the AUDIT stream."""

    arm: str
    target: str = Field(description="adapter, adapter@version or base")
    count: int = Field(ge=0, description="completions served by the arm (cancelled ones excluded)")
    errors: int = Field(ge=0)
    share: Interval = Field(description="the arm's share of the experiment's completions (Wilson)")
    ttft_p50_ms: Interval = Field(description="median TTFT, distribution-free order-statistic interval")
    ttft_p95_ms: float | None = None
    tpot_p50_ms: Interval = Field(description="median TPOT, distribution-free order-statistic interval")
    engine_ms_per_token: Interval = Field(
        description="cost: engine ms per output token (ratio of sums, normal approximation over completions)"
    )
    feedback: int = Field(default=0, ge=0, description="rated completions")
    complaint_rate: Interval = Field(description="completions rated down per completion (Wilson)")
    eval_version: int | None = Field(default=None, description="the version whose platform eval is shown")
    eval_score: Interval = Field(
        default_factory=Interval,
        description="the platform-run eval score of the version the arm serves (its pinned one, else production), "
        "Wilson over the eval set's items; none for the base model or an unevaluated version",
    )


class ExperimentStatusReply(Message):
    experiment: Experiment
    arms: list[ArmFigures]
