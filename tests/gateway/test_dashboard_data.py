"""A tenant admin's dashboard tells cache hits as the worker tells its requests: not for an adapter
the tenant does not own (issue 47), and the hit rate counts only what was told."""

from services.gateway import dashboard_data
from shared.schemas import PlatformEval
from tests.helpers.records import make_record


def completion(adapter_id: str | None, hit: bool | None, ttft_ms: float = 10.0) -> dict:
    return {
        "tenant_id": "acme",
        "adapter_id": adapter_id,
        "adapter_version": 1 if adapter_id else None,
        "cache_hit": hit,
        "ttft_ms": ttft_ms,
        "completion_tokens": 4,
        "ts": 1.0,
    }


def test_a_shared_adapters_hit_is_withheld_from_a_tenant_admin() -> None:
    own = {"mine"}
    rows = [completion("mine", True), completion("common", True), completion(None, True), {"kind": "rejection"}]
    for row in rows:
        row.update(dashboard_data.told_hit(row, own))
    assert [row.get("cache_hit") for row in rows] == [True, None, True, None]
    assert "cache_hit" not in rows[3]


def test_the_hit_rate_counts_only_told_lookups() -> None:
    traffic = dashboard_data.traffic(
        [completion("mine", True), completion("mine", False, 30.0), completion("common", None, 99.0)]
    )
    assert (traffic["requests"], traffic["hit_rate"], traffic["ttft_p95_miss_ms"]) == (3, 0.5, 30.0)
    assert [point[2] for point in traffic["ttft_series"]] == [True, False, None]


def test_a_shadow_run_is_no_tenants_traffic() -> None:
    shadow = {**completion("mine", True), "completion_tokens": 64, "shadow_of": "r1"}
    traffic = dashboard_data.traffic([completion("mine", True), shadow])
    assert traffic["requests"] == 1 and traffic["tenants"]["acme"] == {"requests": 1, "tokens": 4}


def test_the_adapters_table_shows_the_platform_score_and_a_client_claim_as_advisory() -> None:
    run = PlatformEval(eval_set_digest="a" * 64, score=0.25, threshold=0.5, items=4, errors=0)
    rows = dashboard_data.adapters(
        [make_record("sea", 2, eval_results={"score": 1.0}, platform_eval=run), make_record("sea", 1)]
    )
    assert [row["eval"] for row in rows] == [{}, {"platform": 0.25, "threshold": 0.5, "client_advisory": 1.0}]


def test_experiments_show_one_row_per_arm_with_each_figure_and_its_interval():
    from services.registry.experiment_stats import ExperimentStats
    from shared.schemas import CompletionAudit, Experiment, ExperimentStatusReply

    exp = Experiment.model_validate(
        {
            "tenant_id": "acme",
            "name": "ab",
            "started_at": 0.0,
            "state": "stopped",
            "winner": "b",
            "arms": [{"name": "a", "adapter": {"adapter": "sum"}, "weight": 3}, {"name": "b"}],
        }
    )
    stats = ExperimentStats()
    for i in range(8):
        stats.add_completion(
            CompletionAudit(
                request_id=f"r{i}",
                tenant_id="acme",
                base_model="m",
                cache_hit=True,
                ttft_ms=10.0 + i,
                tpot_ms=2.0,
                prompt_tokens=1,
                completion_tokens=2,
                worker_id="w",
                outcome="stop",
                experiment="ab",
                arm="a" if i < 6 else "b",
            )
        )
    rows = dashboard_data.experiments([ExperimentStatusReply(experiment=exp, arms=stats.figures(exp))])
    assert [(r["arm"], r["target"], r["count"], r["state"], r["winner"]) for r in rows] == [
        ("a", "sum", 6, "stopped", "b"),
        ("b", "base", 2, "stopped", "b"),
    ]
    low, value, high = rows[0]["share"][1], rows[0]["share"][0], rows[0]["share"][2]
    assert value == 0.75 and low < value < high
    assert rows[0]["engine_ms_per_token"] == [None, None, None]  # no worker measured it: no figure made up
