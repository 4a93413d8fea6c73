"""Shadow agreement as plain functions: answer digests and their agreement, the registry's pairing
of production and shadow answers by request, the figures, the agreement guard, and its metrics."""

from prometheus_client import REGISTRY

from lorafleet.cli.release_cmd import show
from services.registry.comparison import export_comparison
from services.registry.live_stats import LiveStats
from services.registry.release_policy import ReleasePolicy, agreement_guard, judge
from shared.answer_digest import agreement, checkpoints, digest_answer
from shared.schemas import CompletionAudit, PlatformEval, ReleaseState, VersionFigures

POLICY = ReleasePolicy(min_samples=5, dwell_s=0, guard_min_samples=5, min_shadow_pairs=10, min_agreement=0.8)


def test_checkpoints_are_powers_of_two_then_the_whole_answer() -> None:
    assert checkpoints(0) == [] and checkpoints(1) == [1] and checkpoints(2) == [1, 2]
    assert checkpoints(5) == [1, 2, 4, 5] and checkpoints(8) == [1, 2, 4, 8]


def test_agreement_is_exact_on_the_same_tokens_and_a_prefix_lower_bound_otherwise() -> None:
    same = digest_answer([5, 6, 7, 8, 9])
    assert agreement(same, digest_answer([5, 6, 7, 8, 9])) == (True, 1.0)
    assert agreement(same, digest_answer([5, 6, 7, 8, 10])) == (False, 4 / 5)  # known at 4, not at 5
    assert agreement(same, digest_answer([5, 6, 7, 8, 9, 1, 2, 3])) == (False, 4 / 8)  # longer: its share
    assert agreement(same, digest_answer([1, 6, 7, 8, 9])) == (False, 0.0)
    assert agreement(digest_answer([]), digest_answer([])) == (True, 1.0)
    assert agreement(digest_answer([]), digest_answer([3])) == (False, 0.0)
    assert digest_answer([1, 2]).digest != digest_answer([258]).digest  # fixed-width ids: no concatenation clash


def completion(rid: str, version: int, answer: list[int] | None, *, tenant: str = "acme", shadow: str | None = None,
               ts: float = 100.0, outcome: str = "stop") -> CompletionAudit:  # fmt: skip
    return CompletionAudit(
        ts=ts,
        request_id=rid,
        tenant_id=tenant,
        base_model="tiny",
        adapter_id="sea",
        adapter_version=version,
        cache_hit=True,
        ttft_ms=10,
        tpot_ms=5,
        prompt_tokens=4,
        completion_tokens=len(answer or []),
        worker_id="w1",
        outcome=outcome,  # type: ignore[arg-type]
        shadow_of=shadow,
        answer=digest_answer(answer) if answer is not None else None,
    )


def test_pairs_form_by_tenant_and_request_in_either_order_and_shadows_are_not_served_traffic() -> None:
    stats = LiveStats()
    stats.watch(["sea"])
    stats.add_completion(completion("r1", 1, [1, 2, 3]))
    stats.add_completion(completion("shadow.a", 2, [1, 2, 3], shadow="r1"))  # production first: agrees
    stats.add_completion(completion("shadow.b", 2, [1, 9, 9], shadow="r2"))  # the shadow first: disagrees
    stats.add_completion(completion("r2", 1, [1, 2, 3]))
    # another tenant's request under the same id is another request: its shadow pairs with its own only
    stats.add_completion(completion("shadow.c", 2, [1, 2, 3], tenant="globex", shadow="r3"))
    stats.add_completion(completion("r3", 1, [7], tenant="acme"))
    # a production run whose client left, or a shadow that failed, pairs with nothing
    stats.add_completion(completion("r4", 1, None, outcome="cancelled"))
    stats.add_completion(completion("shadow.d", 2, None, shadow="r4", outcome="error"))
    stats.add_completion(completion("r5", 2, [4, 4]))  # the canary's own served request
    canary = stats.figures("sea", 2, since=0)
    production = stats.figures("sea", 1, since=0)
    assert canary.samples == 1  # r5 only: shadow runs are never the canary's served traffic
    assert production.samples == 3  # r1, r2, r3 (r4 was cancelled)
    assert canary.shadow_pairs == 2 and canary.agreement_rate == 0.5
    assert canary.prefix_agreement == (1.0 + 1 / 3) / 2
    assert production.shadow_pairs == 0 and production.agreement_rate is None
    later = stats.figures("sea", 2, since=101)  # a step's window: pairs before it are not its own
    assert later.shadow_pairs == 0 and later.agreement_rate is None
    stats.watch([])  # the rollout ended: halves waiting for their pair are let go too
    stats.watch(["sea"])
    stats.add_completion(completion("shadow.e", 2, [1], shadow="r3", tenant="globex"))
    assert stats.figures("sea", 2, since=0).shadow_pairs == 0


def figures(version: int, pairs: int, agreed: int, samples: int = 100) -> VersionFigures:
    return VersionFigures(
        version=version,
        samples=samples,
        errors=0,
        error_rate=0.0,
        shadow_pairs=pairs,
        agreement_rate=agreed / pairs if pairs else None,
        prefix_agreement=agreed / pairs if pairs else None,
    )


def test_the_agreement_guard_rolls_back_below_the_threshold_over_enough_pairs_only() -> None:
    baseline = figures(1, 0, 0)
    verdict = judge(figures(2, 20, 10), baseline, 5.0, POLICY)
    assert verdict.action == "rollback"
    assert verdict.reasons == ("shadow agreement 10/20 (0.500, prefix 0.500) with production, below 0.8",)
    assert agreement_guard(figures(2, 9, 0), POLICY) is None  # too few pairs to judge
    assert judge(figures(2, 9, 0), baseline, 5.0, POLICY).action == "hold"
    assert judge(figures(2, 9, 0), baseline, 5.0, POLICY).reasons == ("shadow pairs 9/10",)
    assert judge(figures(2, 20, 16), baseline, 5.0, POLICY).action == "advance"
    # the guard judges pairs, not served samples: a canary at 1% with few completions of its own is judged
    assert judge(figures(2, 20, 2, samples=1), baseline, 5.0, POLICY).action == "rollback"
    off = ReleasePolicy(min_samples=5, dwell_s=0, guard_min_samples=5, min_shadow_pairs=10, min_agreement=0.0)
    assert judge(figures(2, 20, 0), baseline, 5.0, off).action == "advance"  # 0: shown, not judged


def test_the_comparison_metrics_are_canary_minus_production() -> None:
    evaluated = PlatformEval(
        eval_set_digest="0" * 64, score=0.6, threshold=0.5, items=10, errors=0, baseline_version=1, baseline_score=0.8
    )
    export_comparison("cmp", figures(2, 20, 15), 1, evaluated)
    labels = {"adapter": "cmp", "canary_version": "2", "production_version": "1"}

    def value(name: str, measure: str) -> float | None:
        return REGISTRY.get_sample_value(name, {**labels, "measure": measure})

    assert value("shadow_agreement_ratio", "exact") == 0.75
    assert value("quality_regression", "exact") == -0.25
    assert value("quality_regression", "prefix") == -0.25
    assert abs((value("quality_regression", "eval_score") or 0) + 0.2) < 1e-9


def test_release_status_shows_the_canarys_shadow_agreement() -> None:
    state = ReleaseState(
        adapter_id="sea", tenant_id="acme", version=2, baseline_version=1, steps=[1, 100], actor="t", owner="r1",
        figures=[figures(2, 20, 10), figures(1, 0, 0)],
    )  # fmt: skip
    canary, production = show(state).splitlines()[1:3]
    assert canary.endswith("shadow agreement 50.0% (prefix 50.0%) of 20")
    assert "shadow" not in production
