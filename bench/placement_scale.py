"""Placement at fleet scale: FCFS+affinity against the class-aware queue with load shedding, with and
without rank pools, on one trace.

``python -m bench.placement_scale [--quick] [--requests N] [--workers N] [--adapters N]``: runs the
simulation of ``bench.placement_sim`` (the model, its defaults and its cost are described there) at
0.9x and 1.2x the fleet's nominal capacity under each policy, and writes per-class SLO attainment,
shed share, TTFT and GPU hit rate to ``bench/results/placement_scale.{json,md}``.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.cache_sim import git_commit
from bench.placement_sim import POLICIES, RANK_MIX, RANKS, TIER_MIX, Scale, Simulation, Trace, step_s
from shared.config import SloTargets
from shared.schemas import SLO_CLASSES

__all__ = ["POLICIES", "RANKS", "RESULTS", "Scale", "markdown", "run_all", "summarize"]

RESULTS = Path(__file__).parent / "results"


def summarize(sim: Simulation, wall_s: float, cpu_s: float) -> dict:
    ttft, trace, targets = sim.outcome.ttft, sim.trace, sim.targets
    classes = np.array([SLO_CLASSES.index(sim.trace.tiers[t]) for t in range(sim.scale.tenants)])[trace.tenants]
    per_class = {}
    for i, c in enumerate(SLO_CLASSES):
        mine = ttft[classes == i]
        served = mine[~np.isnan(mine)]
        per_class[c] = {
            "requests": len(mine),
            "served": len(served),
            "shed": int(len(mine) - len(served)),
            "shed_share": float((len(mine) - len(served)) / max(1, len(mine))),
            "attainment": float((served <= targets.of(c)).sum() / max(1, len(mine))),
            "ttft_p50_ms": float(np.percentile(served, 50) * 1000) if len(served) else None,
            "ttft_p95_ms": float(np.percentile(served, 95) * 1000) if len(served) else None,
        }
    hits = sum(w.hits for w in sim.workers)
    lookups = sum(w.hits + w.misses for w in sim.workers)
    return {
        "classes": per_class,
        "gpu_hit_rate": hits / max(1, lookups),
        "shed": sum(v["shed"] for v in per_class.values()),
        "spills": sim.spills,
        "on_pool_share": {
            str(r): sim.placed[r, True] / max(1, sim.placed[r, True] + sim.placed[r, False]) for r in RANKS
        },
        "wall_s": wall_s,
        "cpu_s": cpu_s,
    }


def run_all(scale: Scale) -> dict:
    trace = Trace.draw(scale)
    capacity = trace.capacity(scale)
    runs: dict[str, dict] = {}
    for load in scale.loads:
        runs[f"{load:g}x"] = {}
        for policy in POLICIES:
            started, cpu = time.perf_counter(), time.process_time()
            sim = Simulation(scale, trace, policy, load * capacity)
            sim.run()
            run = runs[f"{load:g}x"][policy] = summarize(sim, time.perf_counter() - started, time.process_time() - cpu)
            print(f"{load:g}x {policy}: {run['cpu_s']:.0f} s CPU", file=sys.stderr, flush=True)
    return {
        "mode": "simulation",
        "scale": {k: getattr(scale, k) for k in Scale.__dataclass_fields__},
        "rank_mix": dict(zip(RANKS, RANK_MIX, strict=True)),
        "tier_mix": TIER_MIX,
        "step_s": {str(r): step_s(r) for r in RANKS},
        "targets_s": {c: SloTargets().of(c) for c in SLO_CLASSES},
        "capacity_rps": capacity,
        "runs": runs,
        "environment": {"python": platform.python_version(), "machine": platform.machine(), "git_commit": git_commit()},
    }


def markdown(result: dict) -> str:
    rows = [
        "| load | policy | class | attainment | shed share | TTFT p50 (ms) | TTFT p95 (ms) | GPU hit rate | shed | spills | CPU (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for load, policies in result["runs"].items():
        for policy, r in policies.items():
            for c, s in r["classes"].items():
                p50 = "-" if s["ttft_p50_ms"] is None else f"{s['ttft_p50_ms']:.0f}"
                p95 = "-" if s["ttft_p95_ms"] is None else f"{s['ttft_p95_ms']:.0f}"
                rows.append(
                    f"| {load} | {policy} | {c} | {s['attainment']:.3f} | {s['shed_share']:.3f} | {p50} | {p95} "
                    f"| {r['gpu_hit_rate']:.3f} | {r['shed']} | {r['spills']} | {r['cpu_s']:.1f} |"
                )
    s = result["scale"]
    rows.append(
        f"\nsimulation: {s['workers']} workers, {s['adapters']} adapters, {s['requests']} requests per run, "
        f"nominal capacity {result['capacity_rps']:.0f} req/s"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 workers, 1,000 adapters, 10,000 requests")
    parser.add_argument("--workers", type=int)
    parser.add_argument("--adapters", type=int)
    parser.add_argument("--requests", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="placement_scale", help="result file stem under bench/results")
    args = parser.parse_args()
    scale = Scale(workers=10, adapters=1_000, requests=10_000) if args.quick else Scale()
    sizes = {k: v for k in ("workers", "adapters", "requests") if (v := getattr(args, k)) is not None}
    scale = Scale(**{**{k: getattr(scale, k) for k in Scale.__dataclass_fields__}, **sizes, "seed": args.seed})
    result = run_all(scale)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{args.out}.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
