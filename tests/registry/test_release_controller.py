"""The release controller on a real nats-server's KV, its clock and traffic in the test's hands:
a good version walks every step, a bad one is rolled back on each guard, the eval gate, the
lease between two replicas, and a catalog that moved without the controller."""

import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest
from pydantic import BaseModel

from services.registry.gate import GatePolicy
from services.registry.kv import RecordsKV
from services.registry.live_stats import LiveStats
from services.registry.ops import Registry
from services.registry.push_admission import BaseModelIdentity, IntakePolicy
from services.registry.release_controller import ControllerConfig, ReleaseController
from services.registry.release_policy import ReleasePolicy
from services.registry.releases_kv import ReleasesKV
from shared import subjects
from shared.adapter_format import AdapterLimits
from shared.bus import connect, ensure_streams
from shared.catalog.records import Catalog
from shared.catalog.rollout import choose
from shared.errors import Conflict, ReleaseGateFailed
from shared.schemas import (
    AuditEnvelope,
    AuditEvent,
    CompletionAudit,
    FeedbackAudit,
    PlatformEval,
    ReleaseDecisionAudit,
    ReleaseStartRequest,
    ReleaseState,
    ReleaseStatusRequest,
    RollbackRequest,
    RolloutRequest,
)
from tests.helpers.records import make_record

POLICY = ReleasePolicy(min_samples=20, dwell_s=5.0, guard_min_samples=10)
STEPS = (1.0, 10.0, 50.0, 100.0)
LEASE_S = 5.0
EVAL_SET = "e" * 64  # the sha256 of v2's eval set
# the registry's own run of it, on v2 and on production v1: no worker is asked again here
EVALUATED = PlatformEval(
    eval_set_digest=EVAL_SET, score=0.9, threshold=0.5, items=4, errors=0, baseline_version=1, baseline_score=0.9
)
Behaviour = Callable[[int, int], dict]  # (version, i) -> CompletionAudit fields


def same(version: int, i: int) -> dict:
    return {}


@dataclass
class Clock:
    now: float = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    registry: Registry
    releases: ReleasesKV
    clock: Clock
    base: BaseModelIdentity
    records: RecordsKV
    published: list = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)

    def controller(
        self, instance: str = "reg-a", stats: LiveStats | None = None, registry: Registry | None = None
    ) -> ReleaseController:
        config = ControllerConfig(instance, STEPS, GatePolicy(require_eval=True), LEASE_S)
        return ReleaseController(
            registry or self.registry, self.releases, stats or LiveStats(), POLICY, config, self._audit, self.clock
        )

    async def _publish(self, subject: str, message: BaseModel) -> None:
        self.published.append((subject, message))

    async def _audit(self, event: AuditEvent) -> None:
        self.published.append((subjects.audit(event.kind, event.tenant_id), AuditEnvelope(body=event)))

    def traffic(self, stats: LiveStats, requests: int, behaviour: Behaviour = same) -> list[CompletionAudit]:
        """``requests`` completions split between the versions as the gateway would split them."""
        production, canary = self.registry.catalog.released("sea")
        served = []
        for _ in range(requests):
            i = next(self.counter)
            record = choose(production, canary, f"user-{i}")
            assert record is not None
            fields = {"ttft_ms": 50.0, "tpot_ms": 10.0, "completion_tokens": 12, "engine_s": 0.024, "outcome": "stop"}
            fields.update(behaviour(record.version, i))
            completion = CompletionAudit(
                ts=self.clock.now,
                request_id=f"req-{i}",
                tenant_id="acme",
                base_model="tiny-llama",
                adapter_id="sea",
                adapter_version=record.version,
                cache_hit=True,
                prompt_tokens=20,
                worker_id="w1",
                **fields,
            )
            stats.add_completion(completion)
            served.append(completion)
        return served

    def replica(self, catalog: Catalog, records: RecordsKV) -> Registry:
        """A registry over the shared KV buckets with its own in-memory catalog, as a replica has."""
        return Registry(
            catalog=catalog,
            signers={},
            kv=records,
            approved=None,  # type: ignore[arg-type]  # no register here
            uploads=None,  # type: ignore[arg-type]
            base=self.base,
            policy=IntakePolicy(limits=AdapterLimits(max_rank=16, max_weights_bytes=1_000_000), dev_mode=False),
            trusted_dirs=(),
            remote=None,  # type: ignore[arg-type]  # no register here
            publish=self._publish,
            audit=self._audit,
        )

    def decisions(self) -> list[ReleaseDecisionAudit]:
        return [m.body for _, m in self.published if isinstance(m, AuditEnvelope) and m.body.kind == "release_decision"]

    def status(self, version: int) -> tuple[str, float]:
        record = self.registry.catalog.get("sea", version)
        assert record is not None
        return record.status, record.traffic_percent


@pytest.fixture
async def world(own_nats, base: BaseModelIdentity) -> AsyncIterator[World]:
    nc = await connect(own_nats.url, "release-test")
    js = nc.jetstream()
    await ensure_streams(js)
    clock = Clock()
    catalog = Catalog(
        [
            make_record("sea", 1, "acme", status="production", traffic_percent=100, promoted_at=1.0),
            make_record("sea", 2, "acme", eval_set_digest=EVAL_SET, platform_eval=EVALUATED),
            make_record("sea", 3, "acme", eval_results={"score": 1.0}),  # no eval set: a client's claim alone
        ]
    )
    records = await RecordsKV.open(js)
    for adapter_id in catalog.adapters():
        for record in catalog.versions(adapter_id):
            await records.put_record(record)
    found = World(registry=None, releases=await ReleasesKV.open(js), clock=clock, base=base, records=records)  # type: ignore[arg-type]
    found.registry = found.replica(catalog, records)
    yield found
    await nc.close()


async def start(world: World, controller: ReleaseController, version: int = 2, **kw) -> ReleaseState:
    reply = await controller.start(ReleaseStartRequest(adapter_id="sea", version=version, actor="alice", **kw))
    return reply.releases[0]


async def state_of(controller: ReleaseController) -> ReleaseState:
    return (await controller.status(ReleaseStatusRequest(adapter_id="sea"))).releases[0]


async def run_steps(world: World, controller: ReleaseController, stats: LiveStats, behaviour: Behaviour, rounds: int):
    """Traffic, a clock past the dwell and a tick, per round, until the rollout ends; the canary's
    traffic share seen after each tick."""
    seen = []
    for _ in range(rounds):
        world.traffic(stats, 400, behaviour)
        world.clock.now += POLICY.dwell_s
        await controller.tick()
        seen.append(world.status(2))
        if (await state_of(controller)).phase != "running":
            break
    return seen


async def test_a_good_version_walks_every_step_to_production(world: World) -> None:
    stats = LiveStats()
    controller = world.controller(stats=stats)
    started = await start(world, controller)
    assert (started.phase, started.percent, started.baseline_version) == ("running", 1.0, 1)
    assert world.status(2) == ("canary", 1.0)
    seen = await run_steps(world, controller, stats, same, rounds=60)
    percents = [p for i, (_, p) in enumerate(seen) if i == 0 or p != seen[i - 1][1]]
    assert [p for p in percents if p != 1.0] == [10.0, 50.0, 100.0]
    assert world.status(2) == ("production", 100.0) and world.status(1)[0] == "retired"
    final = await state_of(controller)
    assert final.phase == "released" and [d.action for d in final.decisions] == [
        "started",
        "advanced",
        "advanced",
        "released",
    ]
    audits = world.decisions()
    assert [a.action for a in audits] == ["started", "advanced", "advanced", "released"]
    assert audits[0].reasons == [
        "eval gate passed: platform eval 0.900 on 4 items of set eeeeeeeeeeee, threshold 0.500, production v1 0.900"
    ]
    for audit in audits[1:]:  # each step's decision names the figures it was based on
        assert audit.canary is not None and audit.canary.samples >= POLICY.min_samples
        assert audit.baseline is not None and audit.baseline.samples >= POLICY.min_samples


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        (lambda v, i: {"outcome": "error"} if v == 2 and i % 3 == 0 else {}, "error rate"),
        (lambda v, i: {"ttft_ms": 200.0} if v == 2 else {}, "TTFT p50 ms"),
        (lambda v, i: {"tpot_ms": 40.0} if v == 2 else {}, "TPOT p50 ms"),
        (lambda v, i: {"engine_s": 0.06} if v == 2 else {}, "engine time per output token"),
    ],
    ids=["errors", "ttft", "tpot", "cost"],
)
async def test_a_regressing_canary_is_rolled_back_with_its_figures(
    world: World, behaviour: Behaviour, reason: str
) -> None:
    stats = LiveStats()
    controller = world.controller(stats=stats)
    await start(world, controller)
    seen = await run_steps(world, controller, stats, behaviour, rounds=60)
    assert world.status(2) == ("staging", 0.0) and world.status(1) == ("production", 100.0)
    assert all(p == 1.0 for _, p in seen[:-1])  # it never left the first step
    final = await state_of(controller)
    assert final.phase == "rolled_back"
    audit = world.decisions()[-1]
    assert audit.action == "rolled_back" and audit.reasons[0].startswith(reason)
    assert audit.canary is not None and audit.canary.samples >= POLICY.guard_min_samples
    assert audit.baseline is not None and audit.baseline.version == 1


async def test_a_guard_rolls_back_before_the_step_has_dwelt(world: World) -> None:
    stats = LiveStats()
    controller = world.controller(stats=stats)
    await start(world, controller)
    for _ in range(100):
        if stats.figures("sea", 2, 0.0).samples >= POLICY.guard_min_samples:
            break
        world.traffic(stats, 100, lambda v, i: {"outcome": "error"} if v == 2 else {})
    await controller.tick()  # no time has passed since the step began
    assert world.status(2) == ("staging", 0.0)


async def test_complaints_on_the_canary_roll_it_back(world: World) -> None:
    stats = LiveStats()
    controller = world.controller(stats=stats)
    await start(world, controller)
    for _ in range(100):
        if stats.figures("sea", 2, 0.0).samples >= 2 * POLICY.guard_min_samples:
            break
        for served in world.traffic(stats, 100):
            rating = "down" if served.adapter_version == 2 else "up"
            stats.add_feedback(
                FeedbackAudit(
                    ts=world.clock.now,
                    request_id=served.request_id,
                    tenant_id="acme",
                    adapter_id="sea",
                    adapter_version=served.adapter_version,
                    rating=rating,
                )
            )
    await controller.tick()
    assert world.status(2) == ("staging", 0.0)
    assert world.decisions()[-1].reasons[0].startswith("complaint rate")


async def test_the_eval_gate_is_on_and_a_skipped_eval_is_audited(world: World) -> None:
    controller = world.controller()
    with pytest.raises(ReleaseGateFailed, match="has no eval set"):
        await start(world, controller, version=3)
    assert world.status(3) == ("staging", 0.0)
    assert (await state_of(controller)).phase == "gate_failed"
    assert world.decisions()[-1].action == "gate_failed"
    forced = await start(world, controller, version=3, skip_eval=True, reason="hotfix")
    assert forced.phase == "running" and world.status(3) == ("canary", 1.0)
    assert world.decisions()[-1].reasons == ["eval gate skipped by platform admin alice: hotfix"]
    with pytest.raises(Conflict, match="already being rolled out"):
        await start(world, controller, version=2)


async def test_only_the_lease_holder_drives_and_another_replica_takes_over_a_silent_one(world: World) -> None:
    stats_a, stats_b = LiveStats(), LiveStats()
    stale = world.replica(Catalog(await world.records.load_records()), world.records)  # loaded before reg-a's promote
    a, b = world.controller("reg-a", stats_a), world.controller("reg-b", stats_b, stale)
    await start(world, a)
    for stats in (stats_a, stats_b):
        stats.watch(["sea"])
    world.clock.now += 1.0  # within reg-a's lease
    for _ in range(100):
        if stats_b.figures("sea", 2, 0.0).samples >= POLICY.min_samples:
            break
        for served in world.traffic(stats_b, 400):
            stats_a.add_completion(served)
    world.clock.now = (await state_of(a)).lease_until - 0.1
    await b.tick()
    assert world.status(2) == ("canary", 1.0)  # due to advance, but reg-a holds it
    world.clock.now = (await state_of(a)).lease_until + 0.1  # reg-a fell silent
    await b.tick()
    state = await state_of(b)
    assert (state.phase, state.owner) == ("running", "reg-b")  # it read reg-a's steps from KV: no supersede
    assert stale.catalog.get("sea", 2).traffic_percent == 10.0  # type: ignore[union-attr]
    await a.tick()  # reg-a is back: reg-b's lease holds
    assert (await state_of(a)).owner == "reg-b" and (await state_of(a)).percent == 10.0


async def test_a_rollout_moved_outside_the_controller_is_superseded_or_resumed(world: World) -> None:
    stats = LiveStats()
    controller = world.controller(stats=stats)
    await start(world, controller)
    await world.registry.rollout(RolloutRequest(adapter_id="sea", traffic_percent=10, actor="op"))
    # as if the controller committed a step and crashed before writing its state
    await controller.tick()
    state = await state_of(controller)
    assert (state.phase, state.percent, state.decisions[-1].reasons) == (
        "running",
        10.0,
        ["resumed at the catalog's step"],
    )
    await world.registry.rollback(RollbackRequest(adapter_id="sea", reason="operator", actor="op"))
    await controller.tick()
    state = await state_of(controller)
    assert state.phase == "superseded" and world.decisions()[-1].action == "superseded"
