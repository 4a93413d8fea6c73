"""The release gate through the registry's ops on the in-memory bus (tests/registry/bus_world.py): the
version's own eval set run on a (scripted) worker decides, never a client's claim; an audited
platform-admin skip is the only way past."""

import pytest
from nats.aio.msg import Msg

from shared import subjects
from shared.bus import decode, encode
from shared.errors import (
    InvalidRequest,
    ModelNotFound,
    ReleaseGateFailed,
    ServiceUnavailable,
)
from shared.eval_set import EvalItem, eval_set_digest
from shared.metrics import QUALITY_SCORE
from shared.schemas import (
    AdapterRecordsReply,
    AttachEvalSetRequest,
    AuditEnvelope,
    CatalogSync,
    CatalogSynced,
    GetAdapterRequest,
    PromoteRequest,
    RecordEvalRequest,
    ReleaseStartRequest,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    ServiceHeartbeat,
)
from tests.registry.bus_world import (
    EVAL_SET,
    Wired,
    right,
    wrong,
)


async def test_the_release_gate_refuses_then_promotion_waits_for_the_gateways(wired: Wired) -> None:
    promote = PromoteRequest(adapter_id="sea", version=2, traffic_percent=100, actor="t")
    with pytest.raises(ReleaseGateFailed, match="sea v2 has no eval set"):
        await wired.call("promote", promote, AdapterRecordsReply)
    assert wired.kv.records == [] and wired.published == []  # a refusal changes nothing
    claimed = RecordEvalRequest(adapter_id="sea", version=2, results={"score": 1.0, "threshold": 0.0}, actor="t")
    await wired.call("record_eval", claimed, AdapterRecordsReply)
    with pytest.raises(ReleaseGateFailed, match="sea v2 has no eval set"):  # a client's claim is advisory
        await wired.call("promote", promote, AdapterRecordsReply)

    # one live gateway that confirms every sync, as catalog_follow's on_sync does once its mirror caught up
    syncs: list[int] = []
    gateway = wired.bus.connect("gateway")

    async def on_sync(msg: Msg) -> None:
        syncs.append(decode(CatalogSync, msg.data).revision)
        await gateway.publish(msg.reply, encode(CatalogSynced(instance_id="gw1", revision=syncs[-1])))

    await gateway.subscribe(subjects.GATEWAY_CATALOG_SYNC, cb=on_sync)
    wired.barrier.on_heartbeat(ServiceHeartbeat(service="gateway", instance_id="gw1", ready=True))

    attach = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, actor="t")
    await wired.call("attach_eval_set", attach, AdapterRecordsReply)
    wired.worker.answers = {"sea@2": right, "sea@1": right}
    promoted = await wired.call("promote", promote, AdapterRecordsReply)
    assert [(r.version, r.status) for r in promoted.records] == [(1, "retired"), (2, "production")]
    assert syncs == [2, 3, 5]  # each write's records revision, confirmed before its reply
    [current] = (await wired.call("get", GetAdapterRequest(adapter_id="sea", version=2), AdapterRecordsReply)).records
    assert current.status == "production" and current.platform_eval is not None
    digest = eval_set_digest(EVAL_SET.encode())
    assert (current.platform_eval.eval_set_digest, current.platform_eval.score) == (digest, 1.0)
    assert (current.platform_eval.baseline_version, current.platform_eval.baseline_score) == (1, 1.0)
    # every item asked of both versions on the same set, as the owner tenant, greedy within the set's max_tokens
    assert sorted(wired.worker.asked) == sorted(
        ("demo", model, city, 8) for model in ("sea@1", "sea@2") for city in ("Paris", "Madrid")
    )
    kinds = [m.kind for s, m in wired.published if s.startswith("lf.adapter.event.")]  # type: ignore[attr-defined]
    assert kinds == ["evaluated", "eval_set_attached", "evaluated", "retired", "promoted"]
    assert QUALITY_SCORE.labels("sea", "2")._value.get() == 1.0  # the platform's score, not the client's claim
    assert wired.bus.subjects().count(subjects.GATEWAY_CATALOG_SYNC) == 1  # no sync inbox left behind


async def test_an_eval_set_that_fails_refuses_the_release_whatever_the_client_claimed(wired: Wired) -> None:
    claimed = RecordEvalRequest(adapter_id="sea", version=2, results={"score": 1.0, "threshold": 0.0}, actor="t")
    await wired.call("record_eval", claimed, AdapterRecordsReply)
    attach = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, actor="t")
    await wired.call("attach_eval_set", attach, AdapterRecordsReply)
    wired.worker.answers = {"sea@2": wrong, "sea@1": right}
    promote = PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, actor="t")
    with pytest.raises(ReleaseGateFailed, match=r"sea v2 scored 0\.000 .* under its release threshold 0\.500"):
        await wired.call("promote", promote, AdapterRecordsReply)
    [current] = (await wired.call("get", GetAdapterRequest(adapter_id="sea", version=2), AdapterRecordsReply)).records
    assert current.status == "staging" and current.eval_results["score"] == 1.0
    assert current.platform_eval is not None and current.platform_eval.score == 0.0
    assert QUALITY_SCORE.labels("sea", "2")._value.get() == 0.0
    asked = len(wired.worker.asked)
    with pytest.raises(ReleaseGateFailed, match="under its release threshold"):  # judged again, not run again
        await wired.call("promote", promote, AdapterRecordsReply)
    assert len(wired.worker.asked) == asked


async def test_a_regression_from_production_on_the_same_set_is_refused(wired: Wired) -> None:
    half = EVAL_SET.replace('"threshold": 0.5', '"threshold": 0.4')
    await wired.call(
        "attach_eval_set",
        AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=half, actor="t"),
        AdapterRecordsReply,
    )
    wired.worker.answers = {"sea@2": lambda item: right(item) if item.expected == "Paris" else "", "sea@1": right}
    promote = PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, actor="t")
    with pytest.raises(
        ReleaseGateFailed, match=r"scored 0\.500: a regression beyond 0\.050 from production v1 \(1\.000\)"
    ):
        await wired.call("promote", promote, AdapterRecordsReply)


async def test_only_an_explicit_audited_skip_passes_an_unevaluated_version(wired: Wired) -> None:
    with pytest.raises(ValueError, match="skip_eval needs a reason"):
        PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, skip_eval=True, actor="t")
    skip = PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, skip_eval=True, reason="hotfix", actor="ops")
    promoted = await wired.call("promote", skip, AdapterRecordsReply)
    assert [(r.version, r.status) for r in promoted.records] == [(2, "canary")]
    [audit] = [m.body for s, m in wired.published if isinstance(m, AuditEnvelope)]
    assert audit.kind == "registry_change" and audit.action == "promoted"  # type: ignore[union-attr]
    assert audit.reason == "eval gate skipped by platform admin ops: hotfix"  # type: ignore[union-attr]
    assert wired.worker.asked == []


async def test_an_eval_set_is_validated_and_a_foreign_tenant_cannot_attach_one(wired: Wired) -> None:
    with pytest.raises(InvalidRequest, match="unknown scorer"):
        bad = EVAL_SET.replace("answer_format", "llm_judge")
        await wired.call(
            "attach_eval_set",
            AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=bad, actor="t"),
            AdapterRecordsReply,
        )
    foreign = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, tenant_id="other", actor="t")
    with pytest.raises(ModelNotFound):
        await wired.call("attach_eval_set", foreign, AdapterRecordsReply)
    assert wired.kv.records == []


async def test_an_eval_nobody_answered_is_no_score(wired: Wired) -> None:
    attach = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, actor="t")
    await wired.call("attach_eval_set", attach, AdapterRecordsReply)

    def down(item: EvalItem) -> str:
        raise ServiceUnavailable("no worker")

    wired.worker.answers = {"sea@2": down, "sea@1": right}
    with pytest.raises(ServiceUnavailable, match="no eval request of sea@2 was answered"):
        await wired.call("promote", PromoteRequest(adapter_id="sea", version=2, actor="t"), AdapterRecordsReply)
    [current] = (await wired.call("get", GetAdapterRequest(adapter_id="sea", version=2), AdapterRecordsReply)).records
    assert current.platform_eval is None and current.status == "staging"


async def test_a_release_start_is_gated_and_its_status_shows_the_refusal(wired: Wired) -> None:
    start = ReleaseStartRequest(adapter_id="sea", version=2, actor="t")
    with pytest.raises(ReleaseGateFailed, match="has no eval set"):
        await wired.call("release_start", start, ReleaseStatusReply)
    assert wired.kv.records == []  # the catalog is untouched
    status = await wired.call("release_status", ReleaseStatusRequest(), ReleaseStatusReply)
    [state] = status.releases
    assert (state.adapter_id, state.version, state.phase) == ("sea", 2, "gate_failed")
    assert state.decisions[-1].reasons == [
        "sea v2 has no eval set: push one with it (eval.jsonl) or attach one (`lorafleet adapter attach-eval sea 2 "
        "FILE`); only a platform admin may pass it unevaluated (--skip-eval, audited)"
    ]
