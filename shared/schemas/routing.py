"""Task routes and routing policies: what a tenant's request is served by, as the registry stores it.

A tenant's ``TaskRoutes`` maps task types to adapters (``task:<name>`` as a model, or the
``x-lorafleet-task`` header). ``RoutePolicies`` are ordered rules (one set per tenant, one
platform-wide) whose first match picks an adapter, a task or a refusal. Both live in the KV bucket
``lf_routing`` and carry a revision that every change increments.
"""

import re
import time
from typing import Literal

from pydantic import Field, model_validator

from shared.schemas.base import Identifier, Message, SloClass
from shared.schemas.inference import HEADER_PATTERN, TASK_PATTERN, check_metadata
from shared.schemas.registry import MODEL_NAME_MAX, Actor

MAX_ROUTES = 64
MAX_RULES = 64
MAX_META = 8
_TASK = re.compile(TASK_PATTERN)


class RouteTarget(Message):
    adapter: str = Field(min_length=1, max_length=MODEL_NAME_MAX - 12, pattern=r"^[^@\s]+$")
    version: int | None = Field(default=None, ge=1, description="a pinned version; None: the released one")

    @property
    def model(self) -> str:
        """The model name the normal resolve path takes: ``adapter`` or ``adapter@version``."""
        return self.adapter if self.version is None else f"{self.adapter}@{self.version}"


class TaskRoutes(Message):
    tenant_id: Identifier
    routes: dict[str, RouteTarget] = Field(default_factory=dict, max_length=MAX_ROUTES)
    revision: int = Field(default=0, ge=0, description="incremented by every change")
    updated_by: str = Field(default="", max_length=256)
    updated_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _task_names(self) -> "TaskRoutes":
        for name in self.routes:
            check_task(name)
        return self


def check_task(name: str) -> str:
    if not _TASK.fullmatch(name):
        raise ValueError(f"task {name[:80]!r} must match {TASK_PATTERN}")
    return name


class HeaderMatch(Message):
    name: str = Field(pattern=HEADER_PATTERN)
    value: str = Field(min_length=1, max_length=256)


class PolicyMatch(Message):
    """Every field given must hold (AND); no field given matches every request."""

    tier: SloClass | None = Field(default=None, description="the tenant's SLO tier")
    key_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$", description="the API key's id")
    model: str | None = Field(default=None, min_length=1, max_length=MODEL_NAME_MAX, description="as asked")
    metadata: dict[str, str] = Field(default_factory=dict, max_length=MAX_META, description="request metadata")
    header: HeaderMatch | None = None

    @model_validator(mode="after")
    def _bounded(self) -> "PolicyMatch":
        check_metadata(self.metadata)
        return self


class PolicyTarget(Message):
    """What a matched rule does: serve an adapter, a task's route, an experiment's arm, or refuse."""

    kind: Literal["adapter", "task", "experiment", "refuse"]
    adapter: RouteTarget | None = None
    task: str | None = Field(default=None, pattern=TASK_PATTERN)
    experiment: str | None = Field(default=None, pattern=TASK_PATTERN, description="the tenant's experiment")
    message: str = Field(default="refused by a routing policy", min_length=1, max_length=256)

    @model_validator(mode="after")
    def _one_target(self) -> "PolicyTarget":
        named = {"adapter": self.adapter, "task": self.task, "experiment": self.experiment}
        if any((self.kind == kind) != (value is not None) for kind, value in named.items()):
            raise ValueError("an adapter target names an adapter, a task target a task, an experiment target an "
                             "experiment, and nothing else")  # fmt: skip
        return self


class PolicyRule(Message):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    match: PolicyMatch = Field(default_factory=PolicyMatch)
    target: PolicyTarget


class RoutePolicies(Message):
    tenant_id: Identifier | None = Field(default=None, description="None: the platform-wide rules")
    rules: list[PolicyRule] = Field(default_factory=list, max_length=MAX_RULES)
    revision: int = Field(default=0, ge=0)
    updated_by: str = Field(default="", max_length=256)
    updated_at: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _unique_names(self) -> "RoutePolicies":
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ValueError("rule names must be unique within a policy set")
        return self


# ---- registry ops ----------------------------------------------------------------------------


class SetRoutesRequest(Message):
    tenant_id: Identifier
    routes: dict[str, RouteTarget] = Field(max_length=MAX_ROUTES, description="replaces the whole table")
    actor: Actor


class DeleteRoutesRequest(Message):
    tenant_id: Identifier
    task: str | None = Field(default=None, pattern=TASK_PATTERN, description="None: the whole table")
    actor: Actor


class GetRoutesRequest(Message):
    tenant_id: Identifier


class RoutesReply(Message):
    routes: TaskRoutes


class SetPoliciesRequest(Message):
    tenant_id: Identifier | None = Field(default=None, description="None: the platform-wide rules")
    rules: list[PolicyRule] = Field(max_length=MAX_RULES, description="replaces the whole set")
    actor: Actor


class GetPoliciesRequest(Message):
    tenant_id: Identifier | None = None


class PoliciesReply(Message):
    policies: RoutePolicies


class RouteExplanation(Message):
    """Which rule matched a request and what it is served by."""

    tenant_id: Identifier
    requested: str = Field(description="the model as asked (``auto`` with a task header)")
    rule: str | None = Field(default=None, description="the matching rule's name; None: no rule matched")
    rule_scope: Literal["tenant", "platform"] | None = None
    task: str | None = None
    experiment: str | None = None
    arm: str | None = Field(default=None, description="the experiment's arm this request key is assigned")
    model: str | None = Field(default=None, description="the model name resolved; None when refused")
    adapter_id: str | None = None
    adapter_version: int | None = None
    refused: str | None = Field(default=None, description="the refusal's error code, if refused")
    message: str | None = None
