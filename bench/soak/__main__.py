"""``python -m bench.soak --minutes 30``: see the package docstring."""

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path

import httpx

from bench.load.cli import add_load_options, config_from
from bench.load.client import Outcome, send
from bench.load.report import summarize
from bench.load.run import RESULTS, LoadConfig, Target, environment, fire, open_target, progress
from bench.load.traffic import Arrival
from bench.soak.procstat import Sample, sample_every
from bench.soak.report import markdown, plot
from bench.soak.trend import Tolerance, trend

SERVICES = ("registry", "auditor", "scheduler", "worker", "gateway")
PRIMER = "Tell me a short story about the sea and a lighthouse keeper who lives alone."
TOLERANCE_ARGS = ("rss_tolerance_mb", "rss_tolerance_pct", "files_tolerance")
DEFAULTS = LoadConfig(adapters=100, tenants=4, rate=0.5, count=10_000_000, max_tokens=16)
# Small caches, so their steady state comes within the warm-up: loading and evicting adapters is part of
# it, and the KV cache (zero pages until first written; its allocator cycles through every block) is
# wholly resident early instead of RSS climbing towards the full default budget for many minutes.
WORKER_ENV = {
    "LF_LORA__MAX_SLOTS_PER_CLASS": "8",
    "LF_CACHE__CPU_BUDGET_BYTES": str(64 * 2**20),
    "LF_ENGINE__KV_CACHE_BYTES": str(64 * 2**20),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (sets --duration-s)")
    parser.add_argument("--warmup-min", type=float, help="excluded from the flatness check; default min(5, 30%%)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="sampling period")
    parser.add_argument("--window-s", type=float, default=60.0, help="warm and end figures: medians over this")
    parser.add_argument("--rss-tolerance-mb", type=float, default=Tolerance().rss_mb)
    parser.add_argument("--rss-tolerance-pct", type=float, default=Tolerance().rss_pct)
    parser.add_argument("--files-tolerance", type=int, default=Tolerance().open_files)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json", help="JSON path (.md, .png beside)")
    add_load_options(parser, DEFAULTS)
    args = parser.parse_args(argv)
    args.duration_s = args.minutes * 60
    if args.warmup_min is None:
        args.warmup_min = min(5.0, 0.3 * args.minutes)
    return args


async def prime(target: Target, max_tokens: int, concurrency: int = 8) -> float:
    """One request per adapter, ``concurrency`` at a time, before sampling starts: every adapter slot and
    the CPU tier are then in use (their memory is zero pages until first written), and the worker has
    run batches larger than the moderate load usually forms (its heap keeps the high-water mark of the
    largest batch). Returns the seconds it took."""
    gate = asyncio.Semaphore(concurrency)
    started = time.perf_counter()

    async def one(client: httpx.AsyncClient, i: int, adapter: str, tenant: str) -> None:
        async with gate:
            await send(
                client,
                target.keys[tenant],
                Arrival(i, 0.0, tenant, adapter, PRIMER),
                max_tokens=max_tokens,
                timeout_s=120,
            )

    async with httpx.AsyncClient(base_url=target.url) as client:
        await asyncio.gather(*(one(client, i, a, t) for i, (a, t) in enumerate(target.population.adapters)))
    return time.perf_counter() - started


async def soak(
    target: Target, config: LoadConfig, pids: dict[str, int], interval_s: float
) -> tuple[list[Outcome], float, dict[str, list[Sample]]]:
    """The load run with the sampler beside it: (outcomes, wall seconds, samples by process)."""
    samples: dict[str, list[Sample]] = {}
    stop = asyncio.Event()
    next_report = 0.0

    def report(t_s: float) -> None:
        nonlocal next_report
        if t_s >= next_report:
            next_report += 60
            progress(
                f"{t_s / 60:4.1f} min  RSS MB / files: "
                + ", ".join(f"{n} {v[-1].rss_mb:.0f}/{v[-1].open_files}" for n, v in samples.items() if v)
            )

    sampler = asyncio.create_task(sample_every(pids, interval_s, stop, samples, report))
    try:
        outcomes, wall_s = await fire(target, config)
    finally:
        stop.set()
        await sampler
    return outcomes, wall_s, samples


def verdicts(samples: dict[str, list[Sample]], pids: dict[str, int], args: argparse.Namespace) -> dict[str, dict]:
    tol = Tolerance(args.rss_tolerance_mb, args.rss_tolerance_pct, args.files_tolerance)
    last_s = max(s[-1].t_s for s in samples.values())
    return {
        name: trend(
            samples.get(name, []),
            warmup_s=args.warmup_min * 60,
            window_s=args.window_s,
            last_s=last_s,
            interval_s=args.sample_s,
            tol=tol,
        )
        | {"pid": pid, "infra": name not in SERVICES}
        for name, pid in pids.items()
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    config = config_from(args)
    if config.url is not None:
        raise SystemExit("the soak samples the processes it starts: --url is not supported")
    target = open_target(config, WORKER_ENV)
    started_env = environment(config, target)  # the commit the services started from, not the one at the end
    try:
        assert target.stack is not None  # without --url, open_target started the stack
        pids = target.stack.pids()
        primed_s = asyncio.run(prime(target, config.max_tokens))
        progress(f"primed {len(target.population.adapters)} adapters in {primed_s:.0f} s")
        outcomes, wall_s, samples = asyncio.run(soak(target, config, pids, args.sample_s))
    finally:
        target.close()
    processes = verdicts(samples, pids, args)
    load = summarize(outcomes, wall_s)
    load.pop("per_adapter")
    flat = all(t["flat"] for t in processes.values() if not t["infra"])
    result = {
        "bench": "soak",
        "minutes": args.minutes,
        "warmup_min": args.warmup_min,
        "sample_s": args.sample_s,
        "window_s": args.window_s,
        "primed_s": primed_s,
        "flat": flat,
        "lost": load["lost"],
        "processes": processes,
        "tolerance": {k: getattr(args, k) for k in TOLERANCE_ARGS},
        "worker_env": WORKER_ENV,
        "config": dataclasses.asdict(config),
        "load": load,
        "registration": target.registration,
        "environment": started_env,
        "samples": {n: [dataclasses.asdict(s) for s in v] for n, v in samples.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    title = (
        f"soak {args.minutes:g} min, {target.population.base_model}, {len(target.population.adapters)} "
        f"adapters, {config.rate}/s: {load['completed']} completed, {load['errors']} errors, {load['lost']} lost"
    )
    table = markdown(result)
    args.out.with_suffix(".md").write_text(f"# Soak\n\n{title}; warm-up {args.warmup_min:g} min\n\n{table}\n")
    plot(samples, args.warmup_min * 60, args.out.with_suffix(".png"), title)
    print(f"{title}\n\n{table}")
    return 0 if flat and not load["lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
