"""Task routes and policies as every catalog view holds them, and the one routing step a request
takes before it is resolved: (tenant, model or task, request facts) -> the model name to resolve.

Order: the platform-wide rules, then the tenant's; the first match decides (an adapter, a task,
or a refusal). With no match, ``task:<name>`` (or ``auto`` / no model with a task header) is the
adapter the tenant's task table names. Anything else is resolved as asked. A task the tenant has
no route for is ``TaskNotFound``, whose message lists only the tenant's own tasks and the models
it may call.

``experiment:<name>`` (or a rule's ``experiment`` target) is the arm of the tenant's experiment
that the request's split key (tenant, user) is assigned (``shared.catalog.experiments``); an
unknown experiment is ``ModelNotFound``.

The state mirrors the registry's ``lf_routing`` bucket: ``tasks.<tenant>`` -> ``TaskRoutes``,
``policies.<tenant>`` -> ``RoutePolicies``, ``platform.policies`` the platform-wide set,
``experiments.<tenant>.<name>`` -> ``Experiment``.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from shared.catalog.experiments import EXPERIMENT_PREFIX, EXPERIMENTS_PREFIX, arm_for
from shared.catalog.policy import RequestFacts, first_match
from shared.catalog.rollout import split_key
from shared.errors import InvalidRequest, ModelNotFound, RoutePolicyRefused, ServiceUnavailable, TaskNotFound
from shared.schemas import TASK_PATTERN, Experiment, PolicyRule, RoutePolicies, TaskRoutes

TASK_PREFIX = "task:"
AUTO = "auto"
TASK_HEADER = "x-lorafleet-task"
TASKS_PREFIX = "tasks."
POLICIES_PREFIX = "policies."
PLATFORM_POLICIES = "platform.policies"
LISTED_MAX = 32  # names a TaskNotFound message lists at most
_TASK = re.compile(TASK_PATTERN)


def tasks_key(tenant_id: str) -> str:
    return f"{TASKS_PREFIX}{tenant_id}"


def policies_key(tenant_id: str | None) -> str:
    return PLATFORM_POLICIES if tenant_id is None else f"{POLICIES_PREFIX}{tenant_id}"


@dataclass(frozen=True, slots=True)
class Routed:
    """What a request is resolved as: ``model`` (an adapter name, ``name@version`` or the base
    model), the task it was routed by, the rule that decided (None: no rule matched), and the
    experiment and arm it was assigned (None: none)."""

    model: str
    task: str | None = None
    rule: str | None = None
    scope: Literal["tenant", "platform"] | None = None
    experiment: str | None = None
    arm: str | None = None


class Routes:
    """Every tenant's task table and policy set, plus the platform's policy set."""

    def __init__(self) -> None:
        self.tasks: dict[str, TaskRoutes] = {}
        self.policies: dict[str, RoutePolicies] = {}
        self.platform = RoutePolicies()
        self.experiments: dict[tuple[str, str], Experiment] = {}  # (tenant, name) ->

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """One ``lf_routing`` entry (ValueError: a value that does not decode, skipped by the follower)."""
        if key == PLATFORM_POLICIES:
            self.platform = RoutePolicies.model_validate_json(value) if value is not None else RoutePolicies()
        elif key.startswith(TASKS_PREFIX):
            tenant = key.removeprefix(TASKS_PREFIX)
            if value is None:
                self.tasks.pop(tenant, None)
            else:
                self.tasks[tenant] = TaskRoutes.model_validate_json(value)
        elif key.startswith(EXPERIMENTS_PREFIX):
            tenant, _, name = key.removeprefix(EXPERIMENTS_PREFIX).partition(".")
            if value is None:
                self.experiments.pop((tenant, name), None)
            else:
                self.experiments[(tenant, name)] = Experiment.model_validate_json(value)
        elif key.startswith(POLICIES_PREFIX):
            tenant = key.removeprefix(POLICIES_PREFIX)
            if value is None:
                self.policies.pop(tenant, None)
            else:
                self.policies[tenant] = RoutePolicies.model_validate_json(value)

    def task_table(self, tenant_id: str) -> TaskRoutes:
        return self.tasks.get(tenant_id) or TaskRoutes(tenant_id=tenant_id)

    def tenant_policies(self, tenant_id: str | None) -> RoutePolicies:
        if tenant_id is None:
            return self.platform
        return self.policies.get(tenant_id) or RoutePolicies(tenant_id=tenant_id)

    def header_names(self, tenant_id: str) -> set[str]:
        """The headers some rule of the tenant (or the platform) matches: what the gateway passes on."""
        rules = [*self.platform.rules, *self.tenant_policies(tenant_id).rules]
        return {r.match.header.name for r in rules if r.match.header is not None}

    def route(
        self,
        tenant_id: str,
        model: str | None,
        task: str | None,
        facts: RequestFacts,
        visible: Callable[[], Iterable[str]] = tuple,
        base_model: str | None = None,
    ) -> Routed:
        """The model to resolve for this request, or a typed refusal. ``task``: the task header (or a
        direct submission's ``task``), used when ``model`` is None or ``auto``. ``visible``: the
        model names the tenant may call (listed in a ``TaskNotFound`` only). ``base_model``: what
        an experiment's base arm is served as."""
        asked_task = _asked_task(model, task)
        tenant_rules = self.policies.get(tenant_id)
        if self.platform.rules or (tenant_rules is not None and tenant_rules.rules):
            decided = self._decide(tenant_rules.rules if tenant_rules else [], facts)
            if decided is not None:
                rule, scope = decided
                return self._rule_target(tenant_id, rule, scope, asked_task, visible, facts, base_model)
        if asked_task is None:
            assert model is not None  # _asked_task: no model and no task is refused
            if model.startswith(EXPERIMENT_PREFIX):
                return self._experiment(tenant_id, model.removeprefix(EXPERIMENT_PREFIX), facts, base_model)
            return Routed(model)
        return Routed(self._task_model(tenant_id, asked_task, visible), asked_task)

    def experiment(self, tenant_id: str, name: str) -> Experiment | None:
        return self.experiments.get((tenant_id, name))

    def _experiment(
        self,
        tenant_id: str,
        name: str,
        facts: RequestFacts,
        base_model: str | None,
        rule: str | None = None,
        scope: Literal["tenant", "platform"] | None = None,
        task: str | None = None,
    ) -> Routed:
        experiment = self.experiments.get((tenant_id, name))
        if experiment is None:
            raise ModelNotFound(f"The model '{EXPERIMENT_PREFIX}{name[:64]}' does not exist or you do not have "
                                "access to it.", param="model")  # fmt: skip
        arm = arm_for(experiment, split_key(tenant_id, facts.request_key or ""))
        if arm.adapter is not None:
            model = arm.adapter.model
        elif base_model is not None:
            model = base_model
        else:
            raise ServiceUnavailable("the base model is not known yet; retry", retry_after_s=1.0)
        return Routed(model, task, rule, scope, experiment.name, arm.name)

    def _decide(
        self, tenant_rules: list[PolicyRule], facts: RequestFacts
    ) -> tuple[PolicyRule, Literal["tenant", "platform"]] | None:
        rule = first_match(self.platform.rules, facts)
        if rule is not None:
            return rule, "platform"
        rule = first_match(tenant_rules, facts)
        return (rule, "tenant") if rule is not None else None

    def _rule_target(
        self,
        tenant_id: str,
        rule: PolicyRule,
        scope: Literal["tenant", "platform"],
        asked_task: str | None,
        visible: Callable[[], Iterable[str]],
        facts: RequestFacts,
        base_model: str | None,
    ) -> Routed:
        target = rule.target
        if target.kind == "refuse":
            refused = RoutePolicyRefused(f"{target.message} (rule {rule.name})", param="model")
            refused.rule, refused.scope = rule.name, scope
            raise refused
        if target.kind == "adapter":
            assert target.adapter is not None  # PolicyTarget checks it
            return Routed(target.adapter.model, asked_task, rule.name, scope)
        if target.kind == "experiment":
            assert target.experiment is not None
            return self._experiment(tenant_id, target.experiment, facts, base_model, rule.name, scope, asked_task)
        assert target.task is not None
        return Routed(self._task_model(tenant_id, target.task, visible), target.task, rule.name, scope)

    def _task_model(self, tenant_id: str, task: str, visible: Callable[[], Iterable[str]]) -> str:
        table = self.tasks.get(tenant_id)
        target = table.routes.get(task) if table is not None else None
        if target is None:
            raise task_not_found(task, self.task_table(tenant_id).routes, visible())
        return target.model


def _asked_task(model: str | None, header: str | None) -> str | None:
    if model is not None and model.startswith(TASK_PREFIX):
        return _task_name(model.removeprefix(TASK_PREFIX))
    if model is None or model == AUTO:
        if header is None:
            raise InvalidRequest(f"model '{model or ''}' needs a task: name one in the {TASK_HEADER} header",
                                 param="model")  # fmt: skip
        return _task_name(header)
    return None


def _task_name(name: str) -> str:
    if not _TASK.fullmatch(name):
        raise InvalidRequest(f"task {name[:64]!r} must match {TASK_PATTERN}", param="model")
    return name


def task_not_found(task: str, routes: Iterable[str], visible: Iterable[str]) -> TaskNotFound:
    """A 404 naming only what the tenant may call: its own tasks (as models) and its visible models."""
    names = [f"{TASK_PREFIX}{t}" for t in sorted(routes)] + sorted(visible)
    listed = ", ".join(names[:LISTED_MAX]) + (" ..." if len(names) > LISTED_MAX else "")
    return TaskNotFound(f"no route for task '{task}'. Models you may call: {listed or 'none'}", param="model")
