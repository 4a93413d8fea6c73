"""The release gate on the platform-run score (threshold, regression on the same eval set, required eval
set; client scores never count), eval records, preview resolution."""

import pytest

from services.registry import lifecycle
from services.registry.gate import GatePolicy, check_release, needs_run
from services.registry.service import checks_off
from services.registry.settings import RegistrySettings
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve
from shared.errors import AdapterNotReleased, Conflict, ReleaseGateFailed
from shared.schemas import AdapterRecord, PlatformEval

DIGEST = "0" * 64
SET = "a" * 64  # an eval set's sha256
OTHER_SET = "b" * 64


def record(
    version: int,
    status: str = "staging",
    *,
    eval_set: str | None = SET,
    run: PlatformEval | None = None,
    **results: float,
) -> AdapterRecord:
    return AdapterRecord(
        adapter_id="sql", version=version, tenant_id="demo", base_model="base", base_model_fingerprint=DIGEST,
        task_type="sql", rank=8, alpha=16, target_modules=["q_proj"], files={}, digest=DIGEST,
        manifest_digest=DIGEST, storage_uri="mem://", status=status, eval_results=results,
        eval_set_digest=eval_set, platform_eval=run,
    )  # fmt: skip


def ran(score: float, threshold: float = 0.5, digest: str = SET, **baseline: float | int | None) -> PlatformEval:
    return PlatformEval(
        eval_set_digest=digest, score=score, threshold=threshold, items=4, errors=0, ran_at=1.0, **baseline
    )


def test_a_platform_score_at_or_over_the_threshold_passes() -> None:
    check_release(record(1, run=ran(0.8, threshold=0.8)), None, GatePolicy())


def test_a_platform_score_under_the_threshold_fails_whatever_the_client_claims() -> None:
    claimed = record(1, run=ran(0.2, threshold=0.6), score=1.0, threshold=0.0)
    with pytest.raises(
        ReleaseGateFailed,
        match=r"scored 0\.200 on its eval set a{12} \(run by the platform\), under its release threshold 0\.600",
    ):
        check_release(claimed, None, GatePolicy())


def test_a_client_score_alone_never_passes() -> None:
    with pytest.raises(ReleaseGateFailed, match="has no eval set"):
        check_release(record(1, eval_set=None, score=1.0, threshold=0.0), None, GatePolicy())
    with pytest.raises(ReleaseGateFailed, match="no platform-run score"):
        check_release(record(1, score=1.0), None, GatePolicy())


def test_the_policy_floor_raises_a_lower_eval_set_threshold() -> None:
    with pytest.raises(ReleaseGateFailed, match=r"threshold 0\.500"):
        check_release(record(1, run=ran(0.4, threshold=0.1)), None, GatePolicy(min_score=0.5))


def test_a_regression_from_production_on_the_same_set_beyond_the_margin_fails() -> None:
    production = record(1, "production")
    near = record(2, run=ran(0.86, baseline_version=1, baseline_score=0.9))
    check_release(near, production, GatePolicy(max_regression=0.05))
    far = record(2, run=ran(0.8, baseline_version=1, baseline_score=0.9))
    with pytest.raises(
        ReleaseGateFailed, match=r"regression beyond 0\.050 from production v1 \(0\.900\) on the same eval set"
    ):
        check_release(far, production, GatePolicy(max_regression=0.05))


def test_a_score_of_another_set_or_against_another_production_is_run_again() -> None:
    production = record(1, "production")
    assert needs_run(record(2), production)  # never run
    assert needs_run(record(2, run=ran(0.9, digest=OTHER_SET, baseline_version=1, baseline_score=0.9)), production)
    assert needs_run(record(2, run=ran(0.9)), production)  # run with no production; one serves now
    assert needs_run(record(3, run=ran(0.9, baseline_version=1, baseline_score=0.9)), record(2, "production"))
    assert not needs_run(record(2, run=ran(0.9, baseline_version=1, baseline_score=0.9)), production)
    assert not needs_run(record(2, eval_set=None), production)  # nothing to run: the gate decides
    with pytest.raises(ReleaseGateFailed, match="no platform-run score"):
        check_release(record(2, run=ran(0.9)), production, GatePolicy())


def test_no_eval_set_passes_only_when_a_deployment_turned_the_requirement_off() -> None:
    check_release(record(1, eval_set=None), None, GatePolicy(require_eval=False))
    with pytest.raises(ReleaseGateFailed, match="has no eval set"):
        check_release(record(1, eval_set=None), None, GatePolicy(require_eval=True))
    with pytest.raises(ReleaseGateFailed, match="under its release threshold"):  # a set it has is always run
        check_release(record(1, run=ran(0.1)), None, GatePolicy(require_eval=False))


def test_the_eval_gate_is_on_unless_a_deployment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before issue 47 it was off by default and only ``lorafleet up`` turned it on: under compose,
    the cluster profile and k8s a tenant admin promoted an unevaluated version to 100%."""
    monkeypatch.delenv("LF_RELEASE_REQUIRE_EVAL", raising=False)  # tests/conftest.py's, for the test stacks
    settings = RegistrySettings()
    assert (settings.release_require_eval, settings.release_gate) == (True, True)
    assert checks_off(settings) == []
    with pytest.raises(ReleaseGateFailed, match="has no eval set"):
        check_release(record(1, eval_set=None), None, GatePolicy())
    monkeypatch.setenv("LF_RELEASE_REQUIRE_EVAL", "false")
    assert checks_off(RegistrySettings()) == ["release_require_eval"]  # what its heartbeats tell /readyz


def test_gate_failure_is_a_conflict_with_its_own_code() -> None:
    error = ReleaseGateFailed("x")
    assert isinstance(error, Conflict) and error.status == 409 and error.to_body().code == "release_gate_failed"


def test_record_eval_keeps_status_and_refuses_revoked_versions() -> None:
    catalog = Catalog([record(1, "production"), record(2, "revoked")])
    [change] = lifecycle.record_eval(catalog, "sql", 1, {"score": 0.9, "threshold": 0.6})
    assert change.kind == "evaluated" and change.after.status == "production"
    assert change.after.eval_results == {"score": 0.9, "threshold": 0.6}
    assert change.after.platform_eval is None  # a client's scores are advisory: never the gate's
    with pytest.raises(Conflict, match="revoked"):
        lifecycle.record_eval(catalog, "sql", 2, {"score": 0.9})


def test_a_platform_score_is_recorded_only_on_the_set_the_version_still_has() -> None:
    catalog = Catalog([record(1)])
    [change] = lifecycle.record_platform_eval(catalog, "sql", 1, ran(0.75))
    assert change.kind == "evaluated" and change.after.platform_eval == ran(0.75)
    with pytest.raises(Conflict, match="eval set changed"):
        lifecycle.record_platform_eval(catalog, "sql", 1, ran(0.75, digest=OTHER_SET))


def test_attaching_another_eval_set_drops_the_score_of_the_old_one() -> None:
    catalog = Catalog([record(1, run=ran(0.9)), record(2, "retired")])
    [same] = lifecycle.attach_eval_set(catalog, "sql", 1, SET)
    assert same.after.platform_eval == ran(0.9)
    [other] = lifecycle.attach_eval_set(catalog, "sql", 1, OTHER_SET)
    assert other.kind == "eval_set_attached" and other.after.eval_set_digest == OTHER_SET
    assert other.after.platform_eval is None
    with pytest.raises(Conflict, match="retired"):
        lifecycle.attach_eval_set(catalog, "sql", 2, OTHER_SET)


def test_only_a_pinned_preview_reaches_a_staging_version() -> None:
    catalog = Catalog([record(1, "production"), record(2)])
    assert resolve(catalog, "base", "demo", "sql@2", "k", preview=True).adapter.version == 2
    assert resolve(catalog, "base", "demo", "sql", "k", preview=True).adapter.version == 1
    with pytest.raises(AdapterNotReleased):
        resolve(catalog, "base", "demo", "sql@2", "k")
