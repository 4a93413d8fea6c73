"""The release controller's statistics and decisions as plain functions: figures of a version's
live traffic, the guards, and advance / hold / rollback."""

import pytest

from services.registry.live_stats import LiveStats, percentile
from services.registry.release_policy import ReleasePolicy, guard_trips, judge, wilson_lower
from shared.schemas import CompletionAudit, FeedbackAudit, VersionFigures

POLICY = ReleasePolicy(min_samples=50, dwell_s=10, guard_min_samples=20)


def completion(version: int, i: int, *, ts: float = 100.0, outcome: str = "stop", ttft: float = 50.0, **kw):
    return CompletionAudit(
        ts=ts,
        request_id=f"r{version}-{i}",
        tenant_id="acme",
        base_model="tiny",
        adapter_id="sea",
        adapter_version=version,
        cache_hit=True,
        ttft_ms=ttft,
        tpot_ms=kw.pop("tpot", 10.0),
        prompt_tokens=kw.pop("prompt", 20),
        completion_tokens=kw.pop("tokens", 10),
        engine_s=kw.pop("engine_s", None),
        worker_id="w1",
        outcome=outcome,  # type: ignore[arg-type]
    )


def figures(version: int = 2, samples: int = 100, **kw) -> VersionFigures:
    values = {
        "errors": 0,
        "error_rate": 0.0,
        "ttft_p50_ms": 50.0,
        "ttft_p95_ms": 80.0,
        "tpot_p50_ms": 10.0,
        "tpot_p95_ms": 15.0,
        "tokens_per_request": 30.0,
        "engine_ms_per_token": 2.0,
    }
    values.update(kw)
    if "errors" in kw:
        values["error_rate"] = kw["errors"] / samples
    if "complaints" in kw:
        values["complaint_rate"] = kw["complaints"] / samples
    return VersionFigures(version=version, samples=samples, **values)


def test_percentile_of_no_one_and_many_values() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 95) == 7.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)


def test_figures_count_errors_apart_and_skip_cancelled_and_unwatched_adapters() -> None:
    stats = LiveStats()
    stats.watch(["sea"])
    for i in range(8):
        stats.add_completion(completion(2, i, ttft=10.0 * (i + 1), tokens=i))
    stats.add_completion(completion(2, 100, outcome="error", ttft=9999.0))
    stats.add_completion(completion(2, 101, outcome="cancelled"))
    other = completion(2, 102).model_copy(update={"adapter_id": "lake"})
    stats.add_completion(other)
    got = stats.figures("sea", 2, since=0.0)
    assert (got.samples, got.errors, got.error_rate) == (9, 1, pytest.approx(1 / 9))
    assert got.ttft_p50_ms == pytest.approx(45.0)  # the error's latency is not a served latency
    assert got.tokens_per_request == pytest.approx(20 + 3.5)
    assert stats.figures("lake", 2, since=0.0).samples == 0


def test_cost_is_engine_time_per_output_token_of_the_completions_that_measured_it() -> None:
    stats = LiveStats()
    stats.watch(["sea"])
    stats.add_completion(completion(2, 1, tokens=10, engine_s=0.030))
    stats.add_completion(completion(2, 2, tokens=30, engine_s=0.050))
    stats.add_completion(completion(2, 3, tokens=100))  # a vLLM worker's: no figure, not counted as free
    stats.add_completion(completion(2, 4, tokens=5, engine_s=9.0, outcome="error"))  # not a served completion
    assert stats.figures("sea", 2, since=0.0).engine_ms_per_token == pytest.approx(80 / 40)
    stats.add_completion(completion(3, 1, tokens=10))
    assert stats.figures("sea", 3, since=0.0).engine_ms_per_token is None  # never a made-up figure


def test_a_version_without_a_cost_figure_is_not_judged_on_cost() -> None:
    canary = figures(engine_ms_per_token=None)
    assert guard_trips(canary, figures(1, 2000, engine_ms_per_token=0.1), POLICY) == []
    assert guard_trips(figures(engine_ms_per_token=9.0), figures(1, 2000, engine_ms_per_token=None), POLICY) == []


def test_window_starts_at_the_step_and_forgetting_drops_older_records() -> None:
    stats = LiveStats()
    stats.watch(["sea"])
    stats.add_completion(completion(2, 1, ts=10.0))
    stats.add_completion(completion(2, 2, ts=20.0))
    assert stats.figures("sea", 2, since=15.0).samples == 1
    stats.forget_before("sea", 15.0)
    assert stats.figures("sea", 2, since=0.0).samples == 1


def test_one_rating_per_request_feeds_the_complaint_rate() -> None:
    stats = LiveStats()
    stats.watch(["sea"])
    for i in range(4):
        stats.add_completion(completion(2, i))

    def rate(request: str, rating: str) -> FeedbackAudit:
        return FeedbackAudit(
            ts=100.0, request_id=request, tenant_id="acme", adapter_id="sea", adapter_version=2, rating=rating
        )

    stats.add_feedback(rate("r2-0", "down"))
    stats.add_feedback(rate("r2-0", "down"))  # the same request twice counts once
    stats.add_feedback(rate("r2-1", "up"))
    got = stats.figures("sea", 2, since=0.0)
    assert (got.feedback, got.complaints, got.complaint_rate) == (2, 1, 0.25)
    stats.add_feedback(rate("r2-0", "up"))  # a changed mind replaces the rating
    assert stats.figures("sea", 2, since=0.0).complaints == 0


def test_wilson_lower_bound_is_cautious_with_few_trials() -> None:
    assert wilson_lower(0, 0) == 0.0
    assert wilson_lower(1, 20) < 0.02  # one error in twenty proves little
    assert wilson_lower(6, 20) > 0.1
    assert wilson_lower(50, 1000) == pytest.approx(0.036, abs=0.002)


def test_guards_stay_quiet_below_their_sample_count_and_for_an_equal_canary() -> None:
    assert guard_trips(figures(samples=19, errors=19), figures(1, 2000), POLICY) == []
    assert guard_trips(figures(), figures(1, 2000), POLICY) == []
    assert guard_trips(figures(samples=40, errors=1), figures(1, 2000, errors=0), POLICY) == []


@pytest.mark.parametrize(
    ("canary", "reason"),
    [
        ({"errors": 30}, "error rate"),
        ({"complaints": 25}, "complaint rate"),
        ({"ttft_p95_ms": 200.0}, "TTFT p95"),
        ({"ttft_p50_ms": 120.0}, "TTFT p50"),
        ({"tpot_p50_ms": 30.0}, "TPOT p50"),
        ({"tpot_p95_ms": 40.0}, "TPOT p95"),
        ({"engine_ms_per_token": 4.0}, "engine time per output token"),
    ],
)
def test_each_guard_trips_on_its_own_figure(canary: dict, reason: str) -> None:
    reasons = guard_trips(figures(**canary), figures(1, 2000), POLICY)
    assert len(reasons) == 1 and reasons[0].startswith(reason)


def test_latency_under_the_slack_never_trips_the_ratio() -> None:
    tiny = figures(1, 2000, tpot_p50_ms=1.0, tpot_p95_ms=1.5)
    assert guard_trips(figures(tpot_p50_ms=3.0, tpot_p95_ms=4.0), tiny, POLICY) == []


def test_without_production_traffic_rates_are_held_against_zero_and_ratios_unjudged() -> None:
    assert guard_trips(figures(ttft_p95_ms=10_000.0), None, POLICY) == []
    assert guard_trips(figures(errors=20), figures(1, 5, errors=5), POLICY)[0].startswith("error rate")


def test_judge_holds_until_dwell_and_both_sample_counts_then_advances() -> None:
    base = figures(1, 2000)
    hold = judge(figures(samples=49), base, 11.0, POLICY)
    assert hold.action == "hold" and hold.reasons == ("canary samples 49/50",)
    assert judge(figures(), base, 9.0, POLICY).reasons == ("dwell 9/10 s",)
    assert judge(figures(), figures(1, 30), 11.0, POLICY).reasons == ("production samples 30/50",)
    assert judge(figures(), base, 11.0, POLICY).action == "advance"
    assert judge(figures(), None, 11.0, POLICY).action == "advance"  # a first release has nothing to wait for


def test_a_tripped_guard_rolls_back_before_the_dwell_is_over() -> None:
    verdict = judge(figures(samples=20, errors=12), figures(1, 2000), 0.5, POLICY)
    assert verdict.action == "rollback" and verdict.reasons[0].startswith("error rate 12/20")


def _rating(tenant: str, request: str, rating: str = "down", version: int = 2) -> FeedbackAudit:
    return FeedbackAudit(
        ts=100.0, request_id=request, tenant_id=tenant, adapter_id="sea", adapter_version=version, rating=rating
    )


def test_ratings_are_per_tenant_and_request() -> None:
    """Request ids are per tenant: before issue 47 another tenant's rating under the same id replaced
    this tenant's."""
    stats = LiveStats()
    stats.watch(["sea"])
    for i in range(4):
        stats.add_completion(completion(2, i))
    stats.add_feedback(_rating("acme", "r2-0", "down"))
    stats.add_feedback(_rating("globex", "r2-0", "up"))
    got = stats.figures("sea", 2, since=0.0)
    assert (got.feedback, got.complaints, got.complaining_tenants) == (2, 1, 1)


def _steered(stats: LiveStats, tenants: list[str], per_tenant: int) -> None:
    """Each tenant steers ``per_tenant`` requests onto the canary and rates every one down."""
    for tenant in tenants:
        for i in range(per_tenant):
            rid = f"{tenant}-{i}"
            stats.add_completion(completion(2, 0).model_copy(update={"request_id": rid, "tenant_id": tenant}))
            stats.add_feedback(_rating(tenant, rid))


def test_one_tenant_alone_neither_rolls_back_a_shared_version_nor_outweighs_the_others() -> None:
    """Before issue 47: 25 requests steered onto a shared adapter's 1% canary and 25 down-votes
    rolled it back for every tenant."""
    stats = LiveStats()
    stats.watch(["sea"])
    for i in range(100):  # production: nobody complains
        stats.add_completion(completion(1, i))
    _steered(stats, ["mallory"], 25)
    share = POLICY.max_tenant_complaint_share
    canary = stats.figures("sea", 2, 0.0, tenant_share=share)
    baseline = stats.figures("sea", 1, 0.0, tenant_share=share)
    assert (canary.complaints, canary.complaining_tenants) == (2, 1)  # 10% of 25 completions
    assert guard_trips(canary, baseline, POLICY, shared=True) == []
    assert guard_trips(
        stats.figures("sea", 2, 0.0), baseline, POLICY, shared=False
    )  # a tenant's own adapter: it decides

    _steered(stats, ["acme", "globex"], 25)  # three tenants complaining about the same version
    canary = stats.figures("sea", 2, 0.0, tenant_share=share)
    assert canary.complaining_tenants == 3
    assert guard_trips(canary, baseline, POLICY, shared=True)[0].startswith("complaint rate")


def test_longer_answers_at_the_same_engine_time_per_token_are_no_cost_regression() -> None:
    assert guard_trips(figures(tokens_per_request=300.0), figures(1, 2000), POLICY) == []
