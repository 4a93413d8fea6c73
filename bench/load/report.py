"""Figures of a load run: latency percentiles split by cache hit, per-adapter throughput, errors; JSON,
Markdown and a PNG of the latency distributions."""

import math
from collections import Counter, defaultdict
from pathlib import Path

from bench.load.client import Outcome

GROUPS = ("all", "hit", "miss", "base")


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """Nearest-rank p50/p95/p99 (the smallest value with at least q of the samples at or below it)."""
    ordered = sorted(values)

    def rank(q: float) -> float | None:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99), "n": len(ordered)}


def group_of(outcome: Outcome) -> str:
    """``base`` for base-model requests, else ``hit`` / ``miss`` by whether the adapter was resident."""
    if not outcome.adapter:
        return "base"
    return "hit" if outcome.cache_hit else "miss"


def _split(completed: list[Outcome], field: str) -> dict[str, dict]:
    values: dict[str, list[float]] = defaultdict(list)
    for o in completed:
        value = getattr(o, field)
        if value is not None:
            values["all"].append(value)
            values[group_of(o)].append(value)
    return {g: percentiles(values[g]) for g in GROUPS}


def per_adapter(outcomes: list[Outcome], wall_s: float) -> dict[str, dict]:
    """Requests, completions, tokens and throughput of each model asked for (adapter id or base)."""
    rows: dict[str, dict] = {}
    for o in outcomes:
        row = rows.setdefault(o.model, {"requests": 0, "completed": 0, "tokens": 0, "hits": 0})
        row["requests"] += 1
        if o.status == "completed":
            row["completed"] += 1
            row["tokens"] += o.tokens
            row["hits"] += bool(o.cache_hit)
    for row in rows.values():
        row["req_s"] = row["completed"] / wall_s if wall_s > 0 else 0.0
        row["tok_s"] = row["tokens"] / wall_s if wall_s > 0 else 0.0
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["requests"]))


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    """Every figure of the run; each outcome is counted in exactly one of completed, errors, lost."""
    completed = [o for o in outcomes if o.status == "completed"]
    errors = Counter(o.code for o in outcomes if o.status == "error")
    lost = Counter(o.code for o in outcomes if o.status == "lost")
    served = [o for o in completed if o.adapter]
    ttft, tpot = _split(completed, "ttft_ms"), _split(completed, "tpot_ms")
    lags = [o.lag_ms for o in outcomes]
    tokens = sum(o.tokens for o in completed)
    return {
        "requests": len(outcomes),
        "completed": len(completed),
        "errors": sum(errors.values()),
        "errors_by_code": dict(errors.most_common()),
        "lost": sum(lost.values()),
        "lost_by_reason": dict(lost.most_common()),
        "ttft_p50_ms": ttft["all"]["p50"],
        "ttft_p95_ms": ttft["all"]["p95"],
        "ttft_p99_ms": ttft["all"]["p99"],
        "tpot_p50_ms": tpot["all"]["p50"],
        "tpot_p95_ms": tpot["all"]["p95"],
        "tpot_p99_ms": tpot["all"]["p99"],
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "cache_hit_rate": sum(bool(o.cache_hit) for o in served) / len(served) if served else None,
        "adapter_requests_completed": len(served),
        "wall_s": wall_s,
        "throughput_req_s": len(completed) / wall_s if wall_s > 0 else 0.0,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "send_lag_ms": percentiles(lags),
        "distinct_models": len({o.model for o in outcomes}),
        "per_adapter": per_adapter(outcomes, wall_s),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(result: dict, top: int = 10) -> str:
    s = result["summary"]
    hit = "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.3f}"
    lines = [
        (
            f"requests {s['requests']}: completed {s['completed']}, errors {s['errors']} {s['errors_by_code']}, "
            f"**lost {s['lost']}** {s['lost_by_reason'] or ''}"
        ),
        (
            f"cache hit rate (adapter requests): {hit}; throughput {s['throughput_req_s']:.2f} req/s, "
            f"{s['throughput_tok_s']:.1f} tok/s over {s['wall_s']:.0f} s; send lag p99 {_ms(s['send_lag_ms']['p99'])} ms"
        ),
        "",
        (
            "| group | n | TTFT p50 (ms) | TTFT p95 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p95 (ms) "
            "| TPOT p99 (ms) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group in GROUPS:
        t, p = s["ttft_ms"][group], s["tpot_ms"][group]
        lines.append(
            f"| {group} | {t['n']} | {_ms(t['p50'])} | {_ms(t['p95'])} | {_ms(t['p99'])} "
            f"| {_ms(p['p50'])} | {_ms(p['p95'])} | {_ms(p['p99'])} |"
        )
    lines += [
        "",
        (f"| model (top {top} of {s['distinct_models']} by requests) | requests | completed | hits | req/s | tok/s |"),
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model, row in list(s["per_adapter"].items())[:top]:
        lines.append(
            f"| {model} | {row['requests']} | {row['completed']} | {row['hits']} | {row['req_s']:.3f} "
            f"| {row['tok_s']:.2f} |"
        )
    return "\n".join(lines)


def plot(outcomes: list[Outcome], path: Path, title: str) -> None:
    """TTFT and TPOT distributions (CDF) per group, and TTFT over the run coloured by group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    completed = [o for o in outcomes if o.status == "completed" and o.ttft_ms is not None]
    colours = {"hit": "tab:green", "miss": "tab:red", "base": "tab:blue"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, field, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        for group, colour in colours.items():
            values = sorted(getattr(o, field) for o in completed if group_of(o) == group and getattr(o, field))
            if values:
                ax.step(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    where="post",
                    color=colour,
                    label=f"{group} (n={len(values)})",
                )
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    for group, colour in colours.items():
        points = [(o.at_s, o.ttft_ms) for o in completed if group_of(o) == group]
        if points:
            axes[2].scatter(*zip(*points, strict=True), s=8, color=colour, label=group)
    axes[2].set_yscale("log")
    axes[2].set_xlabel("scheduled at (s)")
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].grid(alpha=0.3)
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
