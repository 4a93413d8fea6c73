"""One load run end to end: bring up (or find) the target, register adapters, fire the schedule,
write ``<name>.json`` + ``.md`` + ``.png``."""

import asyncio
import json
import os
import platform
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch
from nats.aio.client import Client as NATS

from bench.cache_sim import git_commit
from bench.load.adapters import parse_rank_mix, plan_adapters, register_adapters
from bench.load.client import Outcome, run_open_loop, send
from bench.load.report import markdown, plot, summarize
from bench.load.stack import BenchStack, create_tenants, list_models, start_stack, wait_keys
from bench.load.traffic import Arrival, Population, parse_slo_mix, prompt, schedule
from lorafleet.cli.adapter_cmd import cli_connect
from lorafleet.cli.infra import cluster_url
from shared import subjects

RESULTS = Path(__file__).resolve().parent.parent / "results"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    base_model: str = "smollm2"  # smollm2 | tiny | tiny-h64
    engine: str = "builtin"  # the started stack's worker engine: builtin | vllm
    adapters: int = 1000
    tenants: int = 10
    rate: float = 0.5  # requests/s, Poisson
    count: int = 300
    duration_s: float = 600.0
    zipf_s: float = 1.1
    base_share: float = 0.1
    max_tokens: int = 16
    seed: int = 0
    timeout_s: float = 120.0
    drain_s: float = 130.0
    rank_mix: str = "8:4,16:3,32:2,64:1"
    slo_mix: str = ""  # interactive:w,standard:w,batch:w: the SLO class each request asks for ('' = none)
    workers: int = 1
    shape: str = "single"  # the started stack: single | cluster (bench/load/stack.py)
    kill_nats_at_s: float | None = None  # kill -9 one NATS node this long into the run (cluster shape)
    kill_nats: str = "infer_leader"  # which node: infer_leader | follower (leads no INFER replica)
    push_concurrency: int = 8
    warmup: int = 2
    url: str | None = None
    keys: tuple[str, ...] = field(default_factory=tuple)


@dataclass(slots=True)
class Target:
    url: str
    keys: dict[str, str]  # tenant -> bearer key
    population: Population
    stack: BenchStack | None = None
    registration: dict | None = None
    fault: dict | None = None  # what was killed during the run, and when

    @property
    def urls(self) -> list[str]:
        return self.stack.urls if self.stack is not None else [self.url]

    def close(self, keep_logs: bool = False) -> None:
        if self.stack is not None:
            self.stack.stop(keep_logs=keep_logs)
            if keep_logs:
                progress(f"logs kept: {self.stack.root / 'logs'}")


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def open_target(config: LoadConfig, extra_env: dict[str, str] | None = None) -> Target:
    """The already running stack at ``config.url``, or a fresh one (services get ``extra_env``) with
    tenants and adapters registered."""
    if config.url is not None:
        return asyncio.run(_existing(config, config.url))
    started = time.perf_counter()
    stack = start_stack(
        config.base_model,
        workers=config.workers,
        request_timeout_s=max(1.0, config.timeout_s - 15),  # the platform's bound comes first
        extra_env=extra_env,
        engine=config.engine,
        shape=config.shape,
    )
    progress(
        f"stack ready in {time.perf_counter() - started:.0f} s (logs {stack.root / 'logs'}); "
        f"registering {config.adapters} adapters"
    )
    try:
        target = asyncio.run(_populate(config, stack))
    except BaseException:
        stack.stop(keep_logs=True)
        raise
    reg = target.registration
    assert reg is not None  # _populate registers the adapters
    progress(f"registered {reg['adapters']} adapters ({reg['weight_bytes'] / 2**20:.0f} MiB) in {reg['seconds']:.1f} s")
    return target


async def _populate(config: LoadConfig, stack: BenchStack) -> Target:
    tenants = [f"load-t{i:02d}" for i in range(config.tenants)]
    keys = await create_tenants(stack.nats_url, tenants)
    plans = plan_adapters(config.adapters, tenants, parse_rank_mix(config.rank_mix), config.seed)
    registration = await register_adapters(
        stack.nats_url, stack.model_dir, plans, concurrency=config.push_concurrency, seed=config.seed
    )
    for url in stack.urls:
        await wait_keys(url, keys)
    population = Population(stack.model_name, tuple(tenants), tuple((p.adapter_id, p.tenant) for p in plans))
    return Target(stack.url, keys, population, stack, registration)


async def _existing(config: LoadConfig, url: str) -> Target:
    """Tenants are the given keys; each one's adapters are what /v1/models lists for it."""
    keys = {f"key-{i}": key for i, key in enumerate(config.keys)}
    owners: dict[str, str] = {}
    base: str | None = None
    for tenant, key in keys.items():
        models = await list_models(url, key)
        base = base or models[0]["id"]
        for model in models[1:]:
            owners.setdefault(model["id"], tenant)
    if base is None:
        raise ValueError("a running target needs at least one key")
    adapters = tuple(sorted(owners.items()))[: config.adapters]
    return Target(url, keys, Population(base, tuple(keys), adapters))


async def _warm(target: Target, config: LoadConfig) -> None:
    """A few base-model requests one at a time, outside the figures (first-use costs of each process)."""
    rng = random.Random(-1)
    async with httpx.AsyncClient(base_url=target.url, timeout=config.timeout_s) as client:
        tenant = target.population.tenants[0]
        for i in range(config.warmup):
            arrival = Arrival(-1 - i, 0.0, tenant, target.population.base_model, prompt(rng))
            await send(client, target.keys[tenant], arrival, max_tokens=config.max_tokens, timeout_s=config.timeout_s)


def arrivals_for(target: Target, config: LoadConfig) -> list[Arrival]:
    return schedule(
        target.population,
        rate=config.rate,
        count=config.count,
        duration_s=config.duration_s,
        zipf_s=config.zipf_s,
        base_share=config.base_share,
        seed=config.seed,
        slo_mix=parse_slo_mix(config.slo_mix),
    )


async def fire(target: Target, config: LoadConfig) -> tuple[list[Outcome], float]:
    """Warm up, then the open-loop run: (outcomes, wall seconds)."""
    await _warm(target, config)
    arrivals = arrivals_for(target, config)
    span = arrivals[-1].at_s if arrivals else 0.0
    progress(
        f"firing {len(arrivals)} requests over {span:.0f} s at {config.rate}/s "
        f"(then up to {config.drain_s:.0f} s drain)"
    )
    killer = None
    if config.kill_nats_at_s is not None:
        assert target.stack is not None, "config_from refuses a fault without a started stack"
        killer = asyncio.create_task(kill_nats_node(target, config.kill_nats, config.kill_nats_at_s))
    try:
        return await run_open_loop(
            target.urls,
            target.keys,
            arrivals,
            max_tokens=config.max_tokens,
            timeout_s=config.timeout_s,
            drain_s=config.drain_s,
        )
    finally:
        if killer is not None:
            target.fault = await killer


async def kill_nats_node(target: Target, which: str, at_s: float) -> dict:
    """After ``at_s`` s, kill -9 the NATS node leading the INFER stream (``infer_leader``) or one leading
    none of its replicas (``follower``); what was killed, when, and where the stream's leader went."""
    assert target.stack is not None
    nodes = target.stack.nodes
    await asyncio.sleep(at_s)
    leader = await infer_leader(target.stack.nats_url)
    victim = next(n for n in nodes if (n.name == leader) == (which == "infer_leader"))
    victim.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(victim.proc.wait)
    progress(f"killed NATS node {victim.name} ({which}, INFER leader was {leader}) at {at_s:.0f} s")
    survivors = await cli_connect(cluster_url([n for n in nodes if n is not victim]))
    deadline = time.monotonic() + 60
    moved = None
    try:
        while time.monotonic() < deadline:  # a new leader is elected among the survivors: one client asks
            try:
                moved = await _leader_of_infer(survivors)
            except Exception:  # the cluster is still electing: ask again
                moved = None
            if moved is not None and moved != victim.name:
                break
            await asyncio.sleep(0.2)
    finally:
        await survivors.close()
    return {
        "killed": victim.name,
        "which": which,
        "at_s": at_s,
        "infer_leader_before": leader,
        "infer_leader_after": moved,
    }


async def infer_leader(nats_url: str) -> str | None:
    nc = await cli_connect(nats_url)
    try:
        return await _leader_of_infer(nc)
    finally:
        await nc.close()


async def _leader_of_infer(nc: NATS) -> str | None:
    info = await nc.jetstream().stream_info(subjects.INFER_STREAM)
    return info.cluster.leader if info.cluster else None


def environment(config: LoadConfig, target: Target) -> dict:
    """The machine, and the worker's engine settings as the started stack inherits them from this environment."""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "worker_threads": os.environ.get("LF_ENGINE__NUM_THREADS", "torch default"),
        "device": os.environ.get("LF_ENGINE__DEVICE", "cpu"),
        "dtype": os.environ.get("LF_ENGINE__DTYPE", "float32"),
        "model": target.population.base_model,
        "engine": config.engine if target.stack else "of the running target",
        "git_commit": git_commit(),
        "load_avg_1m": os.getloadavg()[0],
        "target": "started by the bench" if target.stack else config.url,
        "shape": describe_shape(target),
    }


def describe_shape(target: Target) -> dict | None:
    """How many of each process the started stack ran (None: a running target's is unknown)."""
    if target.stack is None:
        return None
    counts: dict[str, int] = {"nats-server": len(target.stack.nodes)}
    for key in target.stack.stack.procs:
        name = key.split("-")[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def result_of(config: LoadConfig, target: Target, outcomes: list[Outcome], wall_s: float) -> dict:
    summary = summarize(outcomes, wall_s)
    headline = {k: v for k, v in summary.items() if k not in ("per_adapter", "ttft_ms", "tpot_ms", "send_lag_ms")}
    return {
        "bench": "load",
        **headline,
        "config": asdict(config) | {"keys": len(config.keys)},
        "adapters_registered": len(target.population.adapters),
        "tenants": len(target.population.tenants),
        "registration": target.registration,
        "fault": target.fault,
        "environment": environment(config, target),
        "summary": summary,
        "outcomes": [asdict(o) for o in outcomes],
    }


def write(result: dict, outcomes: list[Outcome], out: Path) -> str:
    """``out`` (JSON), and beside it the Markdown table and the PNG plot; returns the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    c = result["config"]
    reg = result["registration"]
    pushed = f", registered in {reg['seconds']:.1f} s ({reg['per_s']:.1f}/s)" if reg else ""
    title = (
        f"{result['environment']['model']}: {result['adapters_registered']} adapters{pushed}, "
        f"{result['tenants']} tenants, Poisson {c['rate']}/s, zipf({c['zipf_s']}), max_tokens {c['max_tokens']}"
    )
    table = markdown(result)
    out.with_suffix(".md").write_text(f"# Open-loop load\n\n{title}\n\n{table}\n")
    plot(outcomes, out.with_suffix(".png"), title)
    return f"{title}\n\n{table}"
