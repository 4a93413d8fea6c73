"""``python -m bench.load.sweep``: an open-loop rate sweep with SLO classes, load shedding off then on.

One stack per mode, the same seeded schedule at each rate. Every request asks for an SLO class
(``--slo-mix``); the bench's tenants have the interactive tier, so every class may be asked for.
Per rate and mode:
- goodput: requests served within their class's TTFT target, per second of the run;
- TTFT p50 / p95 of the admitted (completed) requests, overall and by class;
- refusals by code, and the latency of the refusals (time to the 429);
- lost: none may be.

The knee is the highest rate at which, shedding off, goodput is at least ``--knee-share`` of the rate
offered (the requests of the seeded Poisson draw over its span).
The headline compares, shedding on, the admitted TTFT p95 at the knee with that at twice the knee (the
nearest swept rate at or above it), and the slowest refusal, against the targets the issue sets:
p95 at 2x knee <= 2x p95 at the knee, every refusal in < 1 s."""

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from bench.load.cli import QUICK, add_load_options, config_from
from bench.load.client import Outcome
from bench.load.report import percentiles
from bench.load.run import RESULTS, LoadConfig, environment, fire, open_target, progress
from bench.load.stack import set_tiers
from bench.load.traffic import parse_slo_mix
from shared.config import SloTargets

MODES = {"off": {"LF_SHED_OVERLOAD": "false"}, "on": {"LF_SHED_OVERLOAD": "true"}}


def rate_figures(outcomes: list[Outcome], wall_s: float, span_s: float, targets: SloTargets) -> dict:
    """The figures of one rate: goodput, admitted TTFT, refusals and their latency, lost."""
    completed = [o for o in outcomes if o.status == "completed"]
    refused = [o for o in outcomes if o.status == "error"]
    classes = sorted({o.priority or "standard" for o in outcomes})

    def good(o: Outcome) -> bool:
        return o.ttft_ms is not None and o.ttft_ms <= targets.of(o.priority or "standard") * 1000  # type: ignore[arg-type]

    by_class = {}
    for c in classes:
        mine = [o for o in outcomes if (o.priority or "standard") == c]
        served = [o for o in mine if o.status == "completed"]
        by_class[c] = {
            "requests": len(mine),
            "completed": len(served),
            "within_target": sum(good(o) for o in served),
            "attainment": sum(good(o) for o in served) / len(mine) if mine else None,
            "refused": len(mine) - len(served) - sum(o.status == "lost" for o in mine),
            "ttft_ms": percentiles([o.ttft_ms for o in served if o.ttft_ms is not None]),
        }
    codes: dict[str, int] = {}
    for o in refused:
        codes[str(o.code)] = codes.get(str(o.code), 0) + 1
    return {
        "requests": len(outcomes),
        "completed": len(completed),
        "lost": sum(o.status == "lost" for o in outcomes),
        "offered_req_s": len(outcomes) / span_s if span_s > 0 else 0.0,  # the Poisson draw's own rate
        "goodput_req_s": sum(good(o) for o in completed) / span_s if span_s > 0 else 0.0,
        "throughput_req_s": len(completed) / wall_s if wall_s > 0 else 0.0,
        "ttft_ms": percentiles([o.ttft_ms for o in completed if o.ttft_ms is not None]),
        "refusals": codes,
        "refusal_latency_ms": percentiles([o.latency_ms for o in refused if o.latency_ms is not None])
        | {"max": max((o.latency_ms or 0.0 for o in refused), default=None)},
        "refusal_latency_ms_by_code": {
            code: percentiles([o.latency_ms for o in refused if str(o.code) == code and o.latency_ms is not None])
            | {"max": max((o.latency_ms or 0.0 for o in refused if str(o.code) == code), default=None)}
            for code in codes
        },
        "by_class": by_class,
    }


def headline(sweep: dict[str, dict[str, dict]], rates: list[float], knee_share: float) -> dict:
    """The knee (shedding off) and the shedding-on figures at the knee and at twice it."""
    off, on = sweep.get("off", {}), sweep.get("on", {})
    knee = None
    for rate in rates:
        row = off.get(str(rate))
        if row is not None and row["goodput_req_s"] >= knee_share * row.get("offered_req_s", rate):
            knee = rate
    out: dict = {"knee_rate": knee}
    if knee is None or not on:
        return out
    double = next((r for r in rates if r >= 2 * knee), None)
    out["double_knee_rate"] = double
    at_knee = on.get(str(knee), {}).get("ttft_ms", {}).get("p95")
    at_double = on.get(str(double), {}).get("ttft_ms", {}).get("p95") if double is not None else None
    out["on_p95_ttft_ms_at_knee"] = at_knee
    out["on_p95_ttft_ms_at_double_knee"] = at_double
    if at_knee and at_double is not None:
        out["p95_ratio_double_vs_knee"] = at_double / at_knee
    refusals = [row["refusal_latency_ms"]["max"] for row in on.values() if row["refusal_latency_ms"]["max"]]
    out["on_slowest_refusal_ms"] = max(refusals, default=None)
    shed = [
        row["refusal_latency_ms_by_code"]["overloaded"]["max"]
        for row in on.values()
        if "overloaded" in row.get("refusal_latency_ms_by_code", {})
    ]
    out["on_slowest_overloaded_ms"] = max(shed, default=None)
    if off.get(str(double)) is not None and on.get(str(double)) is not None:
        out["goodput_at_double_knee"] = {m: sweep[m][str(double)]["goodput_req_s"] for m in ("off", "on")}
    return out


async def _one_mode(target, config: LoadConfig, rates: list[float], targets: SloTargets, settle_s: float) -> dict:
    rows = {}
    for rate in rates:
        run = replace(config, rate=rate, count=max(1, int(rate * config.duration_s) * 2), warmup=0)
        outcomes, wall_s = await fire(target, run)
        span = max((o.at_s for o in outcomes), default=0.0)
        rows[str(rate)] = rate_figures(outcomes, wall_s, span, targets)
        r = rows[str(rate)]
        progress(
            f"  {rate}/s: goodput {r['goodput_req_s']:.2f}/s, admitted TTFT p95 {_ms(r['ttft_ms']['p95'])} ms, "
            f"refused {sum(r['refusals'].values())}, lost {r['lost']}"
        )
        await asyncio.sleep(settle_s)  # the next rate starts on an empty queue
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(result: dict) -> str:
    lines = [
        "| shedding | rate/s | goodput/s | admitted TTFT p50 / p95 ms | interactive p95 | refused | "
        "refusal p95 / max ms | overloaded p95 / max ms | lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, rows in result["sweep"].items():
        for rate, r in rows.items():
            inter = r["by_class"].get("interactive", {}).get("ttft_ms", {}).get("p95")
            lat = r["refusal_latency_ms"]
            shed = r.get("refusal_latency_ms_by_code", {}).get("overloaded", {"p95": None, "max": None})
            lines.append(
                f"| {mode} | {rate} | {r['goodput_req_s']:.2f} | {_ms(r['ttft_ms']['p50'])} / {_ms(r['ttft_ms']['p95'])} "
                f"| {_ms(inter)} | {sum(r['refusals'].values())} {r['refusals'] or ''} | "
                f"{_ms(lat['p95'])} / {_ms(lat['max'])} | {_ms(shed['p95'])} / {_ms(shed['max'])} | {r['lost']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 rates, 10 s each")
    parser.add_argument("--rates", default="2,4,6,8,12", help="requests/s, comma-separated")
    parser.add_argument("--shed", choices=("both", "on", "off"), default="both", help="modes, off first")
    parser.add_argument("--knee-share", type=float, default=0.9, help="goodput share of the rate at the knee")
    parser.add_argument("--settle-s", type=float, default=5.0, help="pause between rates")
    parser.add_argument("--out", type=Path, default=RESULTS / "load_sweep.json")
    defaults = LoadConfig(adapters=32, tenants=4, max_tokens=32, duration_s=30.0)
    add_load_options(parser, replace(defaults, slo_mix="interactive:1,standard:2,batch:1"))
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**{**QUICK, "duration_s": 10.0, "drain_s": 30.0, "timeout_s": 40.0}, rates="4,16")
        args = parser.parse_args(argv)
    try:
        rates = sorted(float(r) for r in args.rates.split(","))
        config = config_from(args)
        mix = parse_slo_mix(config.slo_mix)
    except ValueError as e:
        parser.error(str(e))
    if config.url is not None:
        parser.error("the sweep starts its own stacks (one per shedding mode): not with --url")
    targets = SloTargets()  # the stacks run the scheduler's defaults
    modes = ["off", "on"] if args.shed == "both" else [args.shed]
    sweep: dict[str, dict] = {}
    env = None
    started = time.perf_counter()
    for mode in modes:
        progress(f"shedding {mode}: starting a stack")
        target = open_target(config, MODES[mode])
        ok = False
        try:
            assert target.stack is not None
            asyncio.run(set_tiers(target.stack.nats_url, list(target.keys), "interactive"))
            time.sleep(1.5)  # the scheduler follows the tenants bucket
            sweep[mode] = asyncio.run(_one_mode(target, config, rates, targets, args.settle_s))
            env = environment(config, target)
            ok = True
        finally:
            target.close(keep_logs=not ok)
    result = {
        "bench": "load_sweep",
        "rates": rates,
        "slo_mix": mix,
        "targets_s": targets.model_dump(),
        "headline": headline(sweep, rates, args.knee_share),
        "sweep": sweep,
        "config": asdict(config),
        "environment": env,
        "wall_s": time.perf_counter() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    table = markdown(result)
    args.out.with_suffix(".md").write_text(
        f"# Rate sweep, SLO classes\n\n{json.dumps(result['headline'])}\n\n{table}\n"
    )
    print(json.dumps(result["headline"], indent=2))
    print(table)
    return 1 if any(r["lost"] for rows in sweep.values() for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
