"""bench.rounds: every figure's min / median / max over the rounds, headlined by the median round."""

import pytest

from bench.rounds import Run, spread, spread_text, summarise


def run(wall_s: float, ttft_s: list[float], tpot_s: list[float], hits: int | None = None) -> Run:
    r: Run = {"wall_s": wall_s, "ttft_s": ttft_s, "tpot_s": tpot_s}
    if hits is not None:
        r["prefix_hit_tokens"], r["prompt_tokens"] = hits, 100
    return r


def test_a_spread_is_min_median_max_and_the_median_of_an_even_count_is_the_middle_pair_mean():
    assert spread([3.0, 1.0, 2.0, 10.0, 5.0]) == {"min": 1.0, "median": 3.0, "max": 10.0}
    assert spread([4.0, 1.0]) == {"min": 1.0, "median": 2.5, "max": 4.0}
    assert spread([7.0]) == {"min": 7.0, "median": 7.0, "max": 7.0}
    with pytest.raises(ValueError):
        spread([])


def test_the_headline_is_the_median_round_not_the_best():
    runs = [run(w, [0.01 * w], [0.001 * w]) for w in (2.0, 1.0, 4.0, 8.0, 5.0)]  # 64 tokens each
    s = summarise(runs, 64)
    assert s["rounds"] == 5 and s["rounds_wall_s"] == [2.0, 1.0, 4.0, 8.0, 5.0]
    assert s["wall_s"] == 4.0 and s["tok_s"] == 16.0  # the median round's 64 / 4, not the best 64 / 1
    assert s["spread"]["tok_s"] == {"min": 8.0, "median": 16.0, "max": 64.0}
    assert s["ttft_ms"] == {"p50": pytest.approx(40.0), "p95": pytest.approx(40.0)}
    assert s["spread"]["tpot_p50_ms"] == pytest.approx({"min": 1.0, "median": 4.0, "max": 8.0})


def test_each_percentile_is_the_median_of_the_rounds_percentiles():
    """p95 of round k, then the median over rounds: a single slow request in one round does not move it."""
    runs = [run(1.0, [0.1] * 19 + [0.1 + k], [0.01] * 20) for k in (0.0, 0.0, 5.0)]
    s = summarise(runs, 20)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["ttft_ms"]["p95"] == pytest.approx(100.0)
    assert s["spread"]["ttft_p95_ms"]["max"] == pytest.approx(100.0)  # index round(0.95 * 19) = 18 of 20
    assert s["spread"]["ttft_p50_ms"]["max"] == pytest.approx(100.0)


def test_the_prefix_cache_figures_come_with_the_engine_rounds_alone():
    assert "prefix_hit_tokens" not in summarise([run(1.0, [0.1], [0.01])], 8)
    s = summarise([run(1.0, [0.1], [0.01], hits) for hits in (10, 30, 20)], 8)
    assert s["prefix_hit_tokens"] == 20 and s["prompt_tokens"] == 100


def test_a_table_cell_gives_the_median_then_the_range():
    assert spread_text({"min": 1.0, "median": 2.25, "max": 4.0}) == "2.2 (1.0-4.0)"
    assert spread_text({"min": 1.0, "median": 2.0, "max": 4.0}, 0) == "2 (1-4)"
