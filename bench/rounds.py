"""Repeated rounds of a benchmark: each round's figures, and their min / median / max over the rounds.

The headline of every figure is its median round: the best round flatters a noisy, shared machine
and the worst punishes it, while the median is what a rerun reproduces. Min and max stay beside it.
"""

import statistics
from typing import NotRequired, TypedDict

DEFAULT_ROUNDS = 5
QUICK_ROUNDS = 3  # the fewest whose median is neither the min nor the max


class Run(TypedDict):
    """One round of one system: its wall time, and each request's TTFT and TPOT."""

    wall_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    prefix_hit_tokens: NotRequired[int]  # the built-in engine's alone
    prompt_tokens: NotRequired[int]


class Spread(TypedDict):
    min: float
    median: float
    max: float


class Summary(TypedDict):
    """A system over its rounds: each headline figure is the median of the rounds' figures."""

    tok_s: float
    wall_s: float
    ttft_ms: dict[str, float]  # p50, p95: the median over rounds of each round's percentile
    tpot_ms: dict[str, float]
    rounds: int
    rounds_wall_s: list[float]
    spread: dict[str, Spread]  # every figure above by name (tok_s, wall_s, ttft_p50_ms, ...)
    prefix_hit_tokens: NotRequired[int]
    prompt_tokens: NotRequired[int]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": statistics.median(ordered), "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]}


def spread(values: list[float]) -> Spread:
    """Min, median and max of one figure over the rounds (at least one)."""
    if not values:
        raise ValueError("a spread needs at least one round")
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def round_figures(run: Run, tokens: int) -> dict[str, float]:
    """One round's figures: ``tokens`` generated in its wall time, and its TTFT / TPOT percentiles in ms."""
    figures = {"tok_s": tokens / run["wall_s"], "wall_s": run["wall_s"]}
    for name, values in (("ttft", run["ttft_s"]), ("tpot", run["tpot_s"])):
        for p, value in percentiles(values).items():
            figures[f"{name}_{p}_ms"] = value * 1e3
    return figures


def summarise(runs: list[Run], tokens: int) -> Summary:
    """Every figure's spread over ``runs`` (each generated ``tokens``), headlined by its median."""
    per_round = [round_figures(r, tokens) for r in runs]
    spreads = {name: spread([f[name] for f in per_round]) for name in per_round[0]}
    median = {name: s["median"] for name, s in spreads.items()}
    summary: Summary = {
        "tok_s": median["tok_s"],
        "wall_s": median["wall_s"],
        "ttft_ms": {"p50": median["ttft_p50_ms"], "p95": median["ttft_p95_ms"]},
        "tpot_ms": {"p50": median["tpot_p50_ms"], "p95": median["tpot_p95_ms"]},
        "rounds": len(runs),
        "rounds_wall_s": [r["wall_s"] for r in runs],
        "spread": spreads,
    }
    if "prefix_hit_tokens" in runs[0]:
        summary["prefix_hit_tokens"] = round(statistics.median(r.get("prefix_hit_tokens", 0) for r in runs))
        summary["prompt_tokens"] = runs[0]["prompt_tokens"]
    return summary


def spread_text(s: Spread, digits: int = 1) -> str:
    """``median (min-max)`` for a table cell."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"
