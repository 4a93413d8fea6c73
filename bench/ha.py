"""What high availability costs and what losing a NATS node does: ``bench.load`` on the single-node
stack, on the cluster profile, and on the cluster profile with a NATS node killed midway, in one
sitting, on the same schedule of requests.

``python -m bench.ha [--quick] [--base-model tiny|smollm2] [--rate R] [--duration-s S]``

- ``single``: one nats-server, one process of each service (``lorafleet up``'s shape);
- ``cluster``: 3 NATS nodes with every stream, KV bucket and object store at replicas 3, two
  registries, two schedulers, two gateways (the client alternates between them, as a round-robin
  balancer would);
- ``cluster_node_killed``: the same, and ``kill -9`` of the node leading the INFER stream halfway
  through the arrivals (it stays down: two of three nodes keep the quorum).

Both shapes run the same number of workers, so the difference is the replication and the service
replicas. Writes ``bench/results/ha.json`` and ``.md`` (and each run's own load JSON beside them).
"""

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

from bench.load.cli import add_load_options, parse_load_args
from bench.load.run import RESULTS, LoadConfig, fire, open_target, progress, result_of, write

QUICK = {"adapters": 20, "tenants": 2, "rate": 4.0, "count": 60, "duration_s": 15.0, "max_tokens": 8}
DEFAULTS = LoadConfig(
    base_model="tiny",
    adapters=50,
    tenants=4,
    rate=4.0,
    count=360,
    duration_s=90.0,
    max_tokens=16,
    workers=2,
    timeout_s=60.0,
    drain_s=65.0,
    warmup=4,
)
HEADLINE = ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p95_ms", "throughput_tok_s")


def runs_of(config: LoadConfig, kill: str) -> dict[str, LoadConfig]:
    """The three runs, in the order they go: same schedule, shape and fault as named."""
    midway = min(config.duration_s, config.count / config.rate) / 2
    return {
        "single": dataclasses.replace(config, shape="single", kill_nats_at_s=None),
        "cluster": dataclasses.replace(config, shape="cluster", kill_nats_at_s=None),
        "cluster_node_killed": dataclasses.replace(config, shape="cluster", kill_nats_at_s=midway, kill_nats=kill),
    }


def one(name: str, config: LoadConfig, out_dir: Path) -> dict:
    progress(f"{name}: starting the {config.shape} stack")
    target = open_target(config)
    outcomes = None
    try:
        outcomes, wall_s = asyncio.run(fire(target, config))
    finally:
        target.close(keep_logs=outcomes is None or any(o.status != "completed" for o in outcomes))
    result = result_of(config, target, outcomes, wall_s)
    print(write(result, outcomes, out_dir / f"ha-{name}.json"))
    return result


def compare(results: dict[str, dict]) -> dict:
    """Each run's headline figures, and the TTFT the cluster adds over the single node (and a lost node over the cluster)."""

    def delta(a: str, b: str) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for key in ("ttft_p50_ms", "ttft_p95_ms"):
            x, y = results[a].get(key), results[b].get(key)
            out[key] = None if x is None or y is None else y - x
        return out

    return {
        "bench": "ha",
        "runs": {
            name: {
                **{k: r.get(k) for k in HEADLINE},
                "requests": r["requests"],
                "completed": r["completed"],
                "errors": r["errors"],
                "errors_by_code": r["errors_by_code"],
                "lost": r["lost"],
                "fault": r["fault"],
                "shape": r["environment"]["shape"],
            }
            for name, r in results.items()
        },
        "added_by_replication": delta("single", "cluster"),
        "added_by_node_loss": delta("cluster", "cluster_node_killed"),
        "lost": sum(r["lost"] for r in results.values()),
        "config": next(iter(results.values()))["config"],
        "environment": next(iter(results.values()))["environment"],
    }


def markdown(summary: dict) -> str:
    lines = [
        "| run | requests | completed | errors | lost | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | tok/s | fault |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for name, r in summary["runs"].items():
        fault = r["fault"]
        what = f"{fault['killed']} ({fault['which']}) at {fault['at_s']:.0f} s" if fault else ""
        lines.append(
            f"| {name} | {r['requests']} | {r['completed']} | {r['errors']} {r['errors_by_code'] or ''} | {r['lost']} | "
            f"{ms(r['ttft_p50_ms'])} | {ms(r['ttft_p95_ms'])} | {ms(r['tpot_p50_ms'])} | {r['throughput_tok_s']:.1f} | {what} |"
        )
    rep, loss = summary["added_by_replication"], summary["added_by_node_loss"]
    lines += [
        "",
        f"TTFT added by replication (cluster - single): p50 {ms(rep['ttft_p50_ms'])} ms, p95 {ms(rep['ttft_p95_ms'])} ms",
        f"TTFT added by the lost node (killed - cluster): p50 {ms(loss['ttft_p50_ms'])} ms, p95 {ms(loss['ttft_p95_ms'])} ms",
        f"lost in all runs: {summary['lost']}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ha", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 adapters, 60 requests over 15 s")
    parser.add_argument("--out", type=Path, default=RESULTS / "ha.json")
    add_load_options(parser, DEFAULTS)
    args, config = parse_load_args(parser, argv, QUICK)
    if config.url is not None:
        parser.error("bench.ha starts each stack itself: not with --url")
    results = {name: one(name, run, args.out.parent) for name, run in runs_of(config, args.kill_nats).items()}
    summary = compare(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))
    table = markdown(summary)
    args.out.with_suffix(".md").write_text(f"# High availability: cost and a lost NATS node\n\n{table}\n")
    print(table)
    return 1 if summary["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
