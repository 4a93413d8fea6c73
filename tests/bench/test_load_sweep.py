"""bench.load.sweep: SLO classes in the schedule, and the sweep's figures (goodput, admitted TTFT,
refusals and their latency, the knee) from outcomes built here."""

import pytest

from bench.load.client import Outcome
from bench.load.sweep import headline, rate_figures
from bench.load.traffic import Population, parse_slo_mix, schedule
from shared.config import SloTargets

POPULATION = Population("base", ("t0", "t1"), tuple((f"a{i:02d}", f"t{i % 2}") for i in range(20)))
TARGETS = SloTargets(interactive=1.0, standard=4.0, batch=30.0)


def plan(**overrides):
    options = {"rate": 50.0, "count": 4_000, "duration_s": 1e9, "zipf_s": 1.1, "base_share": 0.1, "seed": 3}
    return schedule(POPULATION, **(options | overrides))


def test_a_class_mix_draws_each_class_by_weight_and_leaves_the_rest_of_the_schedule_alone():
    mixed = plan(slo_mix=parse_slo_mix("interactive:1,standard:2,batch:1"))
    plain = plan()
    assert [(a.at_s, a.model, a.tenant) for a in mixed] == [(a.at_s, a.model, a.tenant) for a in plain]
    shares = {c: sum(a.priority == c for a in mixed) / len(mixed) for c in ("interactive", "standard", "batch")}
    assert shares == pytest.approx({"interactive": 0.25, "standard": 0.5, "batch": 0.25}, abs=0.03)
    assert all(a.priority is None for a in plain)


@pytest.mark.parametrize("text", ["urgent:1", "batch", "batch:-1", "batch:0"])
def test_a_bad_class_mix_is_refused(text):
    with pytest.raises(ValueError):
        parse_slo_mix(text)


def outcome(i: int, priority: str, status: str = "completed", ttft_ms: float | None = 100.0, **kw) -> Outcome:
    return Outcome(
        i, "t0", "a00", status, kw.pop("code", None), float(i), 0.0, ttft_ms=ttft_ms, priority=priority, **kw
    )


def test_goodput_counts_only_requests_served_within_their_class_target():
    outcomes = [
        outcome(0, "interactive", ttft_ms=500),  # within 1 s
        outcome(1, "interactive", ttft_ms=1500),  # served, but late
        outcome(2, "batch", ttft_ms=20_000),  # within 30 s
        outcome(3, "standard", "error", None, code="overloaded", latency_ms=12.0),
        outcome(4, "standard", "lost", None, code="timeout"),
    ]
    figures = rate_figures(outcomes, wall_s=10.0, span_s=4.0, targets=TARGETS)
    assert figures["goodput_req_s"] == pytest.approx(2 / 4.0)
    assert figures["completed"] == 3 and figures["lost"] == 1 and figures["refusals"] == {"overloaded": 1}
    assert figures["refusal_latency_ms"]["max"] == 12.0
    assert figures["by_class"]["interactive"]["attainment"] == 0.5
    assert figures["by_class"]["standard"] == figures["by_class"]["standard"] | {"refused": 1, "completed": 0}


def test_the_headline_finds_the_knee_with_shedding_off_and_compares_twice_it_with_shedding_on():
    def row(goodput: float, p95: float, slowest: float | None = None) -> dict:
        return {"goodput_req_s": goodput, "ttft_ms": {"p95": p95}, "refusal_latency_ms": {"max": slowest}}

    sweep = {
        "off": {"2.0": row(2.0, 300), "4.0": row(3.9, 500), "8.0": row(1.0, 20_000)},
        "on": {"2.0": row(2.0, 300), "4.0": row(3.9, 480, 40.0), "8.0": row(3.8, 700, 90.0)},
    }
    top = headline(sweep, [2.0, 4.0, 8.0], knee_share=0.9)
    assert top["knee_rate"] == 4.0 and top["double_knee_rate"] == 8.0
    assert top["p95_ratio_double_vs_knee"] == pytest.approx(700 / 480)
    assert top["on_slowest_refusal_ms"] == 90.0
    assert top["goodput_at_double_knee"] == {"off": 1.0, "on": 3.8}
