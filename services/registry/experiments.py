"""Experiments across adapters: the registry ops behind ``lf.registry.experiment_create``,
``experiment_state``, ``experiments`` and ``experiment_status``.

An experiment lives in the ``lf_routing`` bucket (``experiments.<tenant>.<name>``), written as the
task routes are: a compare-and-set against the entry read, the next ``revision``, an ``AdminAudit``
record (``experiment_created`` / ``experiment_state_set``), and a reply once every gateway and
scheduler view holds it. State moves running <-> paused, and either -> stopped with a winner
(final: a new experiment of that name may then replace it). Figures come from ``ExperimentStats``.
"""

import time

from services.registry.experiment_stats import ExperimentStats, wilson
from services.registry.routing import Audit, Read, SyncViews, Write, check_usable
from shared.catalog.experiments import experiment_key
from shared.catalog.records import Catalog
from shared.catalog.resolve import find_adapter
from shared.catalog.routing import Routes
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.schemas import (
    AdminAudit,
    ArmFigures,
    CreateExperimentRequest,
    Experiment,
    ExperimentArm,
    ExperimentReply,
    ExperimentsReply,
    ExperimentStateRequest,
    ExperimentStatusReply,
    GetExperimentRequest,
    ListExperimentsRequest,
)

MOVES = {("running", "paused"), ("paused", "running"), ("running", "stopped"), ("paused", "stopped")}


class Experiments:
    def __init__(
        self, catalog: Catalog, routes: Routes, stats: ExperimentStats, read: Read, write: Write, audit: Audit,
        sync_views: SyncViews,
    ) -> None:  # fmt: skip
        self._catalog, self._routes, self.stats = catalog, routes, stats
        self._read, self._write, self._audit, self._sync = read, write, audit, sync_views

    async def create(self, req: CreateExperimentRequest) -> ExperimentReply:
        for arm in req.arms:
            if arm.adapter is not None:
                check_usable(self._catalog, req.tenant_id, arm.adapter)
        before, revision = await self._get(req.tenant_id, req.name)
        if before is not None and before.state != "stopped":
            raise Conflict(f"experiment '{req.name}' is {before.state}: stop it before replacing it", param="name")
        experiment = Experiment(tenant_id=req.tenant_id, name=req.name, arms=req.arms,
                                revision=(before.revision if before else 0) + 1, updated_by=req.actor)  # fmt: skip
        self.stats.forget(req.tenant_id, req.name)
        await self._store(experiment, revision)
        arms = [a.model_dump(mode="json") for a in experiment.arms]
        await self._record(req.actor, experiment, "experiment_created", arms=arms)
        return ExperimentReply(experiment=experiment)

    async def set_state(self, req: ExperimentStateRequest) -> ExperimentReply:
        before, revision = await self._get(req.tenant_id, req.name)
        if before is None:
            raise self._missing(req.tenant_id, req.name)
        if (before.state, req.state) not in MOVES:
            raise Conflict(f"experiment '{req.name}' is {before.state}: it cannot be set {req.state}", param="state")
        if (req.state == "stopped") != (req.winner is not None):
            raise InvalidRequest("stopping an experiment names its winner, and only stopping does", param="winner")
        if req.winner is not None and req.winner not in {a.name for a in before.arms}:
            raise InvalidRequest(f"'{req.winner}' is not an arm of experiment '{req.name}'", param="winner")
        changed = {"state": req.state, "winner": req.winner, "revision": before.revision + 1,
                   "updated_by": req.actor, "updated_at": time.time()}  # fmt: skip
        experiment = Experiment.model_validate({**before.model_dump(), **changed})  # checked whole
        await self._store(experiment, revision)
        await self._record(req.actor, experiment, "experiment_state_set", state=req.state, winner=req.winner)
        return ExperimentReply(experiment=experiment)

    async def list_experiments(self, req: ListExperimentsRequest) -> ExperimentsReply:
        found = [e for (tenant, _), e in sorted(self._routes.experiments.items()) if tenant == req.tenant_id]
        return ExperimentsReply(experiments=found)

    async def status(self, req: GetExperimentRequest) -> ExperimentStatusReply:
        experiment, _ = await self._get(req.tenant_id, req.name)
        if experiment is None:
            raise self._missing(req.tenant_id, req.name)
        arms = [self._with_eval(experiment.tenant_id, arm, figures)
                for arm, figures in zip(experiment.arms, self.stats.figures(experiment), strict=True)]  # fmt: skip
        return ExperimentStatusReply(experiment=experiment, arms=arms)

    def _with_eval(self, tenant_id: str, arm: ExperimentArm, figures: ArmFigures) -> ArmFigures:
        """The arm's figures with the platform eval of the version it serves (pinned, else production)."""
        if arm.adapter is None:
            return figures
        adapter_id = find_adapter(self._catalog, tenant_id, arm.adapter.adapter)
        if adapter_id is None:
            return figures
        if arm.adapter.version is not None:
            record = self._catalog.get(adapter_id, arm.adapter.version)
        else:
            production, canary = self._catalog.released(adapter_id)
            record = production or canary
        if record is None or record.platform_eval is None:
            return figures
        scored = record.platform_eval
        score = wilson(round(scored.score * scored.items), scored.items).model_copy(update={"value": scored.score})
        return figures.model_copy(update={"eval_version": record.version, "eval_score": score})

    @staticmethod
    def _missing(tenant_id: str, name: str) -> NotFound:
        return NotFound(f"tenant {tenant_id} has no experiment '{name}'", param="name")

    async def _get(self, tenant_id: str, name: str) -> tuple[Experiment | None, int]:
        value, revision = await self._read(experiment_key(tenant_id, name))
        return (Experiment.model_validate_json(value) if value else None), revision

    async def _store(self, experiment: Experiment, revision: int) -> None:
        key = experiment_key(experiment.tenant_id, experiment.name)
        written = await self._write(key, experiment.model_dump_json().encode(), revision)
        await self._sync(0, written)

    async def _record(self, actor: str, experiment: Experiment, action: str, **detail: object) -> None:
        event = AdminAudit.model_validate(
            {
                "actor": actor,
                "tenant_id": experiment.tenant_id,
                "action": action,
                "target": experiment.name,
                "detail": {"revision": experiment.revision, **detail},
            }
        )
        await self._audit(event)
