"""The release controller: drives each rollout through its traffic steps on live figures.

A rollout starts with the eval gate (the version's eval set run on a worker by the registry) and a promote to the first step, then every tick the
replica holding its lease compares the canary with production on the step's live traffic
(``live_stats``), and advances, holds or rolls back (``release_policy``). The state lives in KV
(``releases_kv``), so another replica, or this one restarted, carries on where it stopped.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.registry.comparison import export_comparison
from services.registry.gate import GatePolicy, check_release, summary
from services.registry.live_stats import LiveStats
from services.registry.ops import Registry
from services.registry.release_policy import ReleasePolicy, judge
from services.registry.releases_kv import LostRace, ReleasesKV, Stored
from services.registry.signer_ops import Audit
from shared.catalog.access import SHARED_TENANT
from shared.errors import Conflict, LorafleetError, ModelNotFound, ReleaseGateFailed
from shared.schemas import (
    MAX_DECISIONS,
    DecisionAction,
    PromoteRequest,
    ReleaseDecision,
    ReleaseDecisionAudit,
    ReleaseStartRequest,
    ReleaseState,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    RollbackRequest,
    RolloutRequest,
)

log = structlog.get_logger("registry.release")
ACTOR = "release-controller"


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    instance_id: str
    steps: tuple[float, ...]
    gate: GatePolicy  # the platform-run eval gate before the first step
    lease_s: float


class ReleaseController:
    def __init__(
        self,
        registry: Registry,
        kv: ReleasesKV,
        stats: LiveStats,
        policy: ReleasePolicy,
        config: ControllerConfig,
        audit: Audit,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._kv = kv
        self._stats = stats
        self._policy = policy
        self._config = config
        self._publish_audit = audit
        self._clock = clock

    async def window_start(self) -> float:
        """Where the live figures begin: the oldest running step's start, else now."""
        running = [s.state for s in (await self._kv.load()).values() if s.state.phase == "running"]
        self._stats.watch(s.adapter_id for s in running)
        return min((s.step_started_at for s in running), default=self._clock())

    async def start(self, req: ReleaseStartRequest) -> ReleaseStatusReply:
        """Gate, promote to the first step and hand the rollout to the ticks; returns at once."""
        catalog = self._registry.catalog
        record = catalog.get(req.adapter_id, req.version)
        if record is None:
            raise ModelNotFound(f"adapter {req.adapter_id!r} has no version {req.version}")
        previous = (await self._kv.load()).get(req.adapter_id)
        if previous is not None and previous.state.phase == "running":
            raise Conflict(f"{req.adapter_id} v{previous.state.version} is already being rolled out")
        if record.status != "staging":
            raise Conflict(f"{req.adapter_id} v{req.version} is {record.status}; only a staging version is rolled out")
        production, _ = catalog.released(req.adapter_id)
        now = self._clock()
        state = ReleaseState(
            adapter_id=req.adapter_id,
            tenant_id=record.tenant_id,
            version=req.version,
            baseline_version=production.version if production else None,
            steps=list(self._config.steps),
            actor=req.actor,
            started_at=now,
            step_started_at=now,
            owner=self._config.instance_id,
            lease_until=now + self._config.lease_s,
        )
        revision = previous.revision if previous else None
        if req.skip_eval:
            reasons = [f"eval gate skipped by platform admin {req.actor}: {req.reason}"]
        else:
            try:
                record = await self._registry.evaluate_for_release(req.adapter_id, req.version)
                check_release(record, production, self._config.gate)
            except ReleaseGateFailed as e:
                await self._decide(Stored(state, revision), {"phase": "gate_failed"}, "gate_failed", [e.message])
                raise
            reasons = [f"eval gate passed: {summary(record.platform_eval)}"]
        await self._registry.promote(
            PromoteRequest(
                adapter_id=req.adapter_id,
                version=req.version,
                traffic_percent=state.percent,
                skip_eval=req.skip_eval,
                reason=req.reason,
                actor=req.actor,
            )
        )
        self._stats.also_watch(req.adapter_id)
        phase = "released" if state.percent >= 100 else "running"
        state = await self._decide(Stored(state, revision), {"phase": phase}, "started", reasons)
        return ReleaseStatusReply(releases=[state])

    async def status(self, req: ReleaseStatusRequest) -> ReleaseStatusReply:
        stored = await self._kv.load()
        states = [stored[a].state for a in sorted(stored) if req.adapter_id in (None, a)]
        return ReleaseStatusReply(releases=states)

    async def tick(self) -> None:
        """Judge every running rollout this replica holds, or may take over (its lease ran out)."""
        running = {a: s for a, s in (await self._kv.load()).items() if s.state.phase == "running"}
        self._stats.watch(running)
        for stored in running.values():
            try:
                claimed = await self._claim(stored)
                if claimed is not None:
                    await self._drive(claimed)
            except LostRace:
                log.info("release_taken_over", adapter_id=stored.state.adapter_id)
            except LorafleetError as e:
                log.warning("release_step_failed", adapter_id=stored.state.adapter_id, error=e.message)

    async def _claim(self, stored: Stored) -> Stored | None:
        """``stored`` under this replica's lease, or None while another replica's lease holds."""
        state, now = stored.state, self._clock()
        if state.owner == self._config.instance_id and state.lease_until > now:
            return stored
        if state.lease_until > now:
            return None
        claimed = state.model_copy(
            update={"owner": self._config.instance_id, "lease_until": now + self._config.lease_s}
        )
        stored = Stored(claimed, await self._kv.write(claimed, stored.revision))
        log.info("release_claimed", adapter_id=state.adapter_id, previous_owner=state.owner)
        if state.owner != self._config.instance_id:  # its steps were committed by another replica
            await self._registry.reload(state.adapter_id)
        return stored

    async def _drive(self, stored: Stored) -> None:
        state = stored.state
        reconciled = self._reconcile(state)
        if reconciled is not None:
            action, changes, reason = reconciled
            await self._decide(stored, changes, action, [reason])
            return
        now = self._clock()
        shared = state.tenant_id == SHARED_TENANT
        share = self._policy.max_tenant_complaint_share if shared else None
        canary = self._stats.figures(state.adapter_id, state.version, state.step_started_at, share)
        baseline = None
        if state.baseline_version is not None:
            baseline = self._stats.figures(state.adapter_id, state.baseline_version, state.step_started_at, share)
        figures = [canary, *([baseline] if baseline else [])]
        if state.baseline_version is not None:
            record = self._registry.catalog.get(state.adapter_id, state.version)
            export_comparison(
                state.adapter_id, canary, state.baseline_version, record.platform_eval if record else None
            )
        verdict = judge(canary, baseline, now - state.step_started_at, self._policy, shared)
        if verdict.action == "rollback":
            why = f"v{state.version} at {state.percent:g}%: " + "; ".join(verdict.reasons)
            await self._registry.rollback(RollbackRequest(adapter_id=state.adapter_id, reason=why[:500], actor=ACTOR))
            await self._decide(
                stored, {"phase": "rolled_back", "figures": figures}, "rolled_back", list(verdict.reasons)
            )
        elif verdict.action == "advance":
            percent = state.steps[state.step + 1]
            await self._registry.rollout(
                RolloutRequest(adapter_id=state.adapter_id, traffic_percent=percent, actor=ACTOR)
            )
            update: dict[str, object] = {"step": state.step + 1, "step_started_at": now, "figures": figures}
            if percent >= 100:
                update["phase"] = "released"
            passed = f"step {state.percent:g}% passed: {canary.samples} canary completions in {now - state.step_started_at:.0f} s"
            await self._decide(stored, update, "released" if percent >= 100 else "advanced", [passed])
            self._stats.forget_before(state.adapter_id, now)
        elif stored.state.lease_until - now < self._config.lease_s / 2:  # hold: renew the lease, show the figures
            renewed = state.model_copy(update={"lease_until": now + self._config.lease_s, "figures": figures})
            await self._kv.write(renewed, stored.revision)

    def _reconcile(self, state: ReleaseState) -> tuple[DecisionAction, dict[str, object], str] | None:
        """The catalog moved without this rollout (an operator's rollback, retire or revoke, or a step
        committed just before a crash): the decision that brings the state in line, or None."""
        record = self._registry.catalog.get(state.adapter_id, state.version)
        if record is not None and record.status == "canary" and record.traffic_percent == state.percent:
            return None
        if record is not None and record.status == "production":
            return "released", {"phase": "released", "step": len(state.steps) - 1}, "the version is in production"
        if record is not None and record.status == "canary" and record.traffic_percent in state.steps:
            step = state.steps.index(record.traffic_percent)
            return "advanced", {"step": step, "step_started_at": self._clock()}, "resumed at the catalog's step"
        status = record.status if record else "gone"
        return "superseded", {"phase": "superseded"}, f"the version is {status} outside the controller"

    async def _decide(
        self, stored: Stored, update: dict[str, object], action: DecisionAction, reasons: list[str]
    ) -> ReleaseState:
        """Record one decision in the rollout's KV record and on the audit trail, with its figures."""
        state = stored.state.model_copy(update=update)
        figures = state.figures if "figures" in update else []
        canary = next((f for f in figures if f.version == state.version), None)
        baseline = next((f for f in figures if f.version == state.baseline_version), None)
        percent = 0.0 if state.phase in ("rolled_back", "gate_failed") else state.percent
        decision = ReleaseDecision(action=action, percent=percent, reasons=reasons, canary=canary, baseline=baseline)
        state = state.model_copy(update={"decisions": [*state.decisions, decision][-MAX_DECISIONS:]})
        await self._kv.write(state, stored.revision)
        await self._audit(state, decision)
        log.info("release_decision", adapter_id=state.adapter_id, version=state.version, action=action, reasons=reasons)
        return state

    async def _audit(self, state: ReleaseState, decision: ReleaseDecision) -> None:
        audit = ReleaseDecisionAudit(
            actor=ACTOR,
            tenant_id=state.tenant_id,
            adapter_id=state.adapter_id,
            version=state.version,
            baseline_version=state.baseline_version,
            action=decision.action,
            percent=decision.percent,
            reasons=decision.reasons,
            canary=decision.canary,
            baseline=decision.baseline,
        )
        await self._publish_audit(audit)
