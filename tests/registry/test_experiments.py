"""Experiment ops: versioned and audited state changes over the op table (``wired``), per-arm figures
over a real registry on a real NATS server fed by the AUDIT stream, and the intervals' arithmetic."""

import time
import uuid

import pytest
from nats.aio.client import Client as NATS

from services.registry.experiment_stats import ExperimentStats, cost_interval, median_interval, wilson
from services.registry.live_stats import Sample
from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import request
from shared.errors import Conflict, InvalidRequest, NotFound
from shared.schemas import (
    AdminAudit,
    AuditEnvelope,
    CompletionAudit,
    CreateExperimentRequest,
    Experiment,
    ExperimentReply,
    ExperimentsReply,
    ExperimentStateRequest,
    ExperimentStatusReply,
    FeedbackAudit,
    GetExperimentRequest,
    ListExperimentsRequest,
    PlatformEval,
)
from tests.helpers.records import make_record
from tests.registry.bus_world import Wired

ARMS = [
    {"name": "control", "adapter": {"adapter": "sea", "version": 1}, "weight": 3},
    {"name": "next", "adapter": {"adapter": "sea"}, "weight": 1},
]


def create(tenant: str = "demo", arms: list[dict] = ARMS, name: str = "sea-ab") -> CreateExperimentRequest:
    return CreateExperimentRequest.model_validate({"tenant_id": tenant, "name": name, "arms": arms, "actor": "t"})


def state(to: str, winner: str | None = None, name: str = "sea-ab") -> ExperimentStateRequest:
    return ExperimentStateRequest(tenant_id="demo", name=name, state=to, winner=winner, actor="t")  # type: ignore[arg-type]


async def test_an_experiment_moves_running_paused_stopped_versioned_and_audited(wired: Wired) -> None:
    made = (await wired.call("experiment_create", create(), ExperimentReply)).experiment
    assert (made.state, made.revision) == ("running", 1)
    with pytest.raises(NotFound):  # an arm the tenant may not call: the same 404 as a missing adapter
        await wired.call("experiment_create", create("acme", name="x"), ExperimentReply)
    with pytest.raises(Conflict):  # a running experiment is not replaced
        await wired.call("experiment_create", create(), ExperimentReply)
    paused = (await wired.call("experiment_state", state("paused"), ExperimentReply)).experiment
    resumed = (await wired.call("experiment_state", state("running"), ExperimentReply)).experiment
    assert (paused.state, paused.revision, resumed.state, resumed.revision) == ("paused", 2, "running", 3)
    with pytest.raises(InvalidRequest):  # a stop names its winner
        await wired.call("experiment_state", state("stopped"), ExperimentReply)
    with pytest.raises(InvalidRequest):
        await wired.call("experiment_state", state("stopped", "nobody"), ExperimentReply)
    stopped = (await wired.call("experiment_state", state("stopped", "next"), ExperimentReply)).experiment
    assert (stopped.state, stopped.winner, stopped.revision) == ("stopped", "next", 4)
    with pytest.raises(Conflict):  # stopped is final
        await wired.call("experiment_state", state("running"), ExperimentReply)
    with pytest.raises(NotFound):
        await wired.call("experiment_state", state("paused", name="none"), ExperimentReply)
    assert wired.routes.experiment("demo", "sea-ab") == stopped  # what every view mirrors
    listed = await wired.call("experiments", ListExperimentsRequest(tenant_id="demo"), ExperimentsReply)
    assert [e.name for e in listed.experiments] == ["sea-ab"]
    again = (await wired.call("experiment_create", create(), ExperimentReply)).experiment  # replaces a stopped one
    assert (again.state, again.revision) == ("running", 5)
    audits = [m.body for s, m in wired.published if isinstance(m, AuditEnvelope) and isinstance(m.body, AdminAudit)]
    trail = [(a.action, a.target, a.detail["revision"], a.detail.get("state")) for a in audits]
    assert trail == [
        ("experiment_created", "sea-ab", 1, None),
        ("experiment_state_set", "sea-ab", 2, "paused"),
        ("experiment_state_set", "sea-ab", 3, "running"),
        ("experiment_state_set", "sea-ab", 4, "stopped"),
        ("experiment_created", "sea-ab", 5, None),
    ]


def completion(arm: str, i: int, ttft: float, experiment: str = "base-ab", tenant: str = "demo") -> CompletionAudit:
    return CompletionAudit(
        request_id=f"r{arm}{i}",
        tenant_id=tenant,
        base_model="tiny",
        cache_hit=True,
        ttft_ms=ttft,
        tpot_ms=ttft / 10,
        prompt_tokens=3,
        completion_tokens=4,
        worker_id="w1",
        outcome="stop",
        experiment=experiment,
        arm=arm,
        engine_s=0.004 * (1 + i % 3),
    )


async def test_the_status_op_counts_each_arm_from_the_audit_stream_of_a_real_registry(registry: NATS) -> None:
    base_arms = [{"name": "a", "weight": 1}, {"name": "b", "weight": 1}]
    made = await request(registry, subjects.registry("experiment_create"),
                         create(arms=base_arms, name="base-ab"), ExperimentReply, 5)  # fmt: skip
    assert made.experiment.state == "running"
    js = registry.jetstream()
    records = [completion("a", i, 10.0 + i) for i in range(30)] + [completion("b", i, 50.0 + i) for i in range(10)]
    records.append(completion("a", 99, 1.0, experiment="other"))  # another experiment's
    records.append(completion("a", 98, 1.0, tenant="acme"))  # another tenant's experiment of that name
    for record in records:
        assert await publish_audit(js, record, uuid.uuid4().hex)
    complaint = FeedbackAudit(request_id="rb0", tenant_id="demo", rating="down")
    assert await publish_audit(js, complaint, uuid.uuid4().hex)
    ask = GetExperimentRequest(tenant_id="demo", name="base-ab")
    deadline = time.monotonic() + 10
    while True:  # the registry follows the stream: the figures reach these counts once it has read them
        status = await request(registry, subjects.registry("experiment_status"), ask, ExperimentStatusReply, 5)
        a, b = status.arms
        if (a.count, b.count, b.feedback) == (30, 10, 1) or time.monotonic() > deadline:
            break
    assert (a.arm, a.count, b.arm, b.count, a.feedback, b.feedback) == ("a", 30, "b", 10, 0, 1)
    assert a.share.value == 0.75 and a.share.low < 0.75 < a.share.high
    assert a.ttft_p50_ms.value == 24.5 and a.ttft_p50_ms.low < 24.5 < a.ttft_p50_ms.high
    assert b.ttft_p50_ms.value == 54.5 and b.complaint_rate.value == 0.1
    assert a.engine_ms_per_token.value == pytest.approx(2.0, rel=0.01)  # mean engine 8 ms over 4 tokens
    listed = await request(registry, subjects.registry("experiments"), ListExperimentsRequest(tenant_id="demo"),
                           ExperimentsReply, 5)  # fmt: skip
    assert [e.name for e in listed.experiments] == ["base-ab"]


def test_the_intervals_cover_their_figure_and_narrow_with_more_data():
    small, large = wilson(3, 10), wilson(300, 1000)
    assert small.low < 0.3 < small.high and large.low < 0.3 < large.high
    assert (large.high - large.low) < (small.high - small.low)
    assert wilson(0, 0).value is None and wilson(0, 20).low == 0.0
    values = [float(v) for v in range(101)]
    median = median_interval(values)
    assert (median.value, median.low, median.high) == (50.0, 39.0, 61.0)  # 1-based ranks 40 and 62 of 101
    uniform = [Sample(0.0, False, 1.0, 1.0, 8, 4, 0.008) for _ in range(20)]
    cost = cost_interval(uniform)
    assert cost.value == pytest.approx(2.0) and cost.high == pytest.approx(cost.low)  # no spread, no width


async def test_the_status_shows_each_adapter_arms_platform_eval_with_its_interval(wired: Wired) -> None:
    scored = make_record("sea", 1, "demo", status="production", traffic_percent=100,
                         platform_eval=PlatformEval(eval_set_digest="0" * 64, score=0.8, threshold=0.5, items=20,
                                                    errors=0))  # fmt: skip
    wired.registry.catalog.put(scored)
    arms = [*ARMS, {"name": "base", "weight": 1}]
    await wired.call("experiment_create", create(arms=arms), ExperimentReply)
    status = await wired.call("experiment_status", GetExperimentRequest(tenant_id="demo", name="sea-ab"),
                              ExperimentStatusReply)  # fmt: skip
    control, released, base = status.arms
    assert (control.eval_version, control.eval_score.value) == (1, 0.8)  # the pinned version's
    assert control.eval_score.low < 0.8 < control.eval_score.high  # Wilson over its 20 items
    assert (released.eval_version, released.eval_score.value) == (1, 0.8)  # unpinned: the production version's
    assert (base.eval_version, base.eval_score.value) == (None, None)  # the base model has no eval set


def test_a_rating_counts_for_the_arm_that_served_the_request_and_a_new_experiment_starts_empty():
    stats = ExperimentStats()
    exp = Experiment.model_validate(
        {"tenant_id": "demo", "name": "base-ab", "started_at": 0.0, "arms": [{"name": "a"}, {"name": "b"}]}
    )
    for i in range(4):
        stats.add_completion(completion("a", i, 10.0))
    stats.add_feedback(FeedbackAudit(request_id="ra1", tenant_id="demo", rating="down"))
    stats.add_feedback(FeedbackAudit(request_id="ra1", tenant_id="acme", rating="down"))  # another tenant's id
    a, b = stats.figures(exp)
    assert (a.count, a.feedback, a.complaint_rate.value, b.count) == (4, 1, 0.25, 0)
    stats.forget("demo", "base-ab")
    assert stats.figures(exp)[0].count == 0
