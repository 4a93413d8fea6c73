"""The release gate (threshold, regression tolerance, required eval), eval records, preview resolution."""

import pytest

from services.registry import lifecycle
from services.registry.gate import GatePolicy, check_release
from services.registry.service import checks_off
from services.registry.settings import RegistrySettings
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve
from shared.errors import AdapterNotReleased, Conflict, ReleaseGateFailed
from shared.schemas import AdapterRecord

DIGEST = "0" * 64


def record(version: int, status: str = "staging", **results: float) -> AdapterRecord:
    return AdapterRecord(
        adapter_id="sql", version=version, tenant_id="demo", base_model="base", base_model_fingerprint=DIGEST,
        task_type="sql", rank=8, alpha=16, target_modules=["q_proj"], files={}, digest=DIGEST,
        manifest_digest=DIGEST, storage_uri="mem://", status=status, eval_results=results,
    )  # fmt: skip


def test_a_score_at_or_over_the_threshold_passes() -> None:
    check_release(record(1, score=0.8, threshold=0.8), None, GatePolicy())


def test_a_score_under_the_threshold_fails() -> None:
    with pytest.raises(ReleaseGateFailed, match=r"under its release threshold 0\.600"):
        check_release(record(1, score=0.2, threshold=0.6), None, GatePolicy())


def test_the_policy_floor_raises_a_lower_adapter_threshold() -> None:
    with pytest.raises(ReleaseGateFailed, match=r"threshold 0\.500"):
        check_release(record(1, score=0.4, threshold=0.1), None, GatePolicy(min_score=0.5))


def test_a_regression_beyond_the_tolerance_fails() -> None:
    production = record(1, "production", score=0.9)
    check_release(record(2, score=0.86, threshold=0.5), production, GatePolicy(max_regression=0.05))
    with pytest.raises(ReleaseGateFailed, match=r"regression beyond 0\.050 from production v1"):
        check_release(record(2, score=0.8, threshold=0.5), production, GatePolicy(max_regression=0.05))


def test_no_eval_passes_only_when_evals_are_optional() -> None:
    check_release(record(1), None, GatePolicy(require_eval=False))
    with pytest.raises(ReleaseGateFailed, match="no recorded eval"):
        check_release(record(1), None, GatePolicy(require_eval=True))


def test_the_eval_gate_is_on_unless_a_deployment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before issue 47 it was off by default and only ``lorafleet up`` turned it on: under compose,
    the cluster profile and k8s a tenant admin promoted an unevaluated version to 100%."""
    monkeypatch.delenv("LF_RELEASE_REQUIRE_EVAL", raising=False)  # tests/conftest.py's, for the test stacks
    settings = RegistrySettings()
    assert (settings.release_require_eval, settings.release_gate) == (True, True)
    assert checks_off(settings) == []
    with pytest.raises(ReleaseGateFailed, match="no recorded eval"):
        check_release(record(1), None, GatePolicy())
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
    with pytest.raises(Conflict, match="revoked"):
        lifecycle.record_eval(catalog, "sql", 2, {"score": 0.9})


def test_only_a_pinned_preview_reaches_a_staging_version() -> None:
    catalog = Catalog([record(1, "production"), record(2)])
    assert resolve(catalog, "base", "demo", "sql@2", "k", preview=True).adapter.version == 2
    assert resolve(catalog, "base", "demo", "sql", "k", preview=True).adapter.version == 1
    with pytest.raises(AdapterNotReleased):
        resolve(catalog, "base", "demo", "sql@2", "k")
