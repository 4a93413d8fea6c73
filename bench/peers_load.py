"""bench.peers_stack's open-loop load table: lorafleet's whole stack, ``vllm serve`` and llama.cpp's
``llama-server`` under the same seeded schedule and the same client, one system at a time.

Each system is started, warmed up, sent the schedule and stopped before the next one starts, so it has the
machine to itself while measured. The schedule is bench/load/traffic.py's ``schedule``: Poisson arrivals,
every request streamed, greedy, EOS ignored, for one of N rank-16 q,v adapters drawn zipf(s). The same N
adapters (bench/load/adapters.py's ``write_adapter``, the weights lorafleet's registration pushes) are in
every system: registered in the stack as bench.load registers them, all in vLLM's ``--lora-modules``, all
preloaded in llama-server (GGUF f32, global scales 0) and chosen per request with ``lora``. Each system's
figures are bench/load/report.py's ``summarize``; one that cannot start gets ``not run: <reason>``.
"""

import asyncio
import os
import random
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.load.adapters import AdapterPlan, plan_adapters, write_adapter
from bench.load.client import Outcome, run_open_loop, send
from bench.load.report import summarize
from bench.load.run import LoadConfig, open_target, progress
from bench.load.stack import base_model_dir
from bench.load.traffic import Arrival, Population, prompt, schedule
from bench.peer_servers import start_llama, start_vllm
from bench.peers_build import CACHE, PeerUnavailable, adapter_gguf, llama_server, model_gguf
from shared.fingerprint import BaseModelSpec

LOAD_SYSTEMS = ("lorafleet", "vllm", "llama.cpp")
TENANT = "load-t00"  # the name bench.load gives its first tenant
RANK = 16
VLLM_MAX_LORAS = 8  # distinct adapters in one batch: zipf(1.1) over 32 puts about 8 in 16 requests
VLLM_MAX_SEQS = 16
LLAMA_SLOTS = 4
FIELDS = (
    "requests",
    "completed",
    "errors",
    "errors_by_code",
    "lost",
    "lost_by_reason",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "tpot_p50_ms",
    "throughput_tok_s",
    "throughput_req_s",
    "wall_s",
)


@dataclass(frozen=True, slots=True)
class LoadOptions:
    rate: float = 3.0  # requests/s, Poisson
    duration_s: float = 60.0
    count: int = 100_000  # at most this many requests (the duration usually ends the schedule first)
    adapters: int = 32
    zipf_s: float = 1.1
    max_tokens: int = 32
    seed: int = 0
    timeout_s: float = 120.0
    drain_s: float = 130.0
    base_model: str = "smollm2"  # bench/load/stack.py's base_model_dir: smollm2 | tiny
    warmup: int = 2

    def load_config(self) -> LoadConfig:
        """bench.load's run of the same traffic, for the stack it starts and populates."""
        return LoadConfig(
            base_model=self.base_model,
            adapters=self.adapters,
            tenants=1,
            rate=self.rate,
            count=self.count,
            duration_s=self.duration_s,
            zipf_s=self.zipf_s,
            base_share=0.0,
            max_tokens=self.max_tokens,
            seed=self.seed,
            timeout_s=self.timeout_s,
            drain_s=self.drain_s,
            rank_mix=f"{RANK}:1",
            warmup=self.warmup,
        )


@dataclass(slots=True)
class Target:
    """A started system as the client sees it: where to send, the bearer key and a peer's own body fields."""

    urls: list[str]
    key: str
    extra: Callable[[Arrival], dict] | None = None


class PeerAdapters:
    """The run's adapters as PEFT directories, written the first time a peer needs them."""

    def __init__(self, plans: list[AdapterPlan], model_dir: Path, seed: int, work: Path):
        self.plans, self.model_dir, self.seed, self.work = plans, model_dir, seed, work
        self._dirs: dict[str, Path] = {}

    def dirs(self) -> dict[str, Path]:
        """Adapter id -> directory, each adapter the one registration writes (seed + its index)."""
        if not self._dirs:
            spec = BaseModelSpec.from_model_dir(self.model_dir)
            for i, plan in enumerate(self.plans):
                self._dirs[plan.adapter_id] = write_adapter(self.work / plan.adapter_id, spec, RANK, self.seed + i)
        return self._dirs

    def gguf(self) -> list[Path]:
        """Each adapter as llama.cpp's f32 LoRA GGUF, converted once into the cache (they are seeded)."""
        out = []
        for i, (name, directory) in enumerate(self.dirs().items()):
            cached = CACHE / "gguf" / f"lora-{self.model_dir.name}-r{RANK}-seed{self.seed + i}-f32.gguf"
            if not cached.exists():
                cached.parent.mkdir(parents=True, exist_ok=True)
                partial = self.work / f"{name}.gguf"
                adapter_gguf(directory, self.model_dir, "f32", partial)
                partial.replace(cached)
            out.append(cached)
        return out


def population(options: LoadOptions, model_name: str) -> tuple[Population, list[AdapterPlan]]:
    """One tenant owning every adapter, named and ranked as bench.load plans them for the same seed."""
    plans = plan_adapters(options.adapters, [TENANT], {RANK: 1.0}, options.seed)
    return Population(model_name, (TENANT,), tuple((p.adapter_id, p.tenant) for p in plans)), plans


def start(name: str, options: LoadOptions, adapters: PeerAdapters, build: bool, stack: ExitStack) -> Target:
    """Start one system (stopped when ``stack`` closes); PeerUnavailable when a peer cannot start."""
    threads = len(os.sched_getaffinity(0))
    if name == "lorafleet":
        target = open_target(options.load_config(), {"LF_ENGINE__DTYPE": "float32"})
        stack.callback(target.close)
        return Target(target.urls, target.keys[TENANT])
    if name == "vllm":
        peer = start_vllm(
            adapters.model_dir, adapters.dirs(), "float32", threads, adapters.work / "vllm.log",
            max_loras=VLLM_MAX_LORAS, max_seqs=VLLM_MAX_SEQS,
        )  # fmt: skip
        stack.callback(peer.stop)
        return Target([peer.url], "none")
    if name == "llama.cpp":
        binary = llama_server(build=build)
        gguf = model_gguf(adapters.model_dir, "f32")
        peer = start_llama(binary, gguf, adapters.gguf(), threads, adapters.work / "llama.log", LLAMA_SLOTS)
        stack.callback(peer.stop)
        index = {plan.adapter_id: i for i, plan in enumerate(adapters.plans)}
        return Target(
            [peer.url], "none", lambda a: {"model": peer.model, "lora": [{"id": index[a.model], "scale": 1.0}]}
        )
    raise ValueError(f"no load target {name!r}: one of {', '.join(LOAD_SYSTEMS)}")


async def fire(target: Target, arrivals: list[Arrival], options: LoadOptions) -> tuple[list[Outcome], float]:
    """A few requests one at a time outside the figures (first-use costs), then the open-loop schedule."""
    rng = random.Random(-1)
    async with httpx.AsyncClient(base_url=target.urls[0], timeout=options.timeout_s) as client:
        for i in range(options.warmup):
            warm = Arrival(-1 - i, 0.0, TENANT, arrivals[i % len(arrivals)].model, prompt(rng))
            extra = target.extra(warm) if target.extra else None
            await send(
                client, target.key, warm, max_tokens=options.max_tokens, timeout_s=options.timeout_s, extra=extra
            )
    return await run_open_loop(
        target.urls,
        {TENANT: target.key},
        arrivals,
        max_tokens=options.max_tokens,
        timeout_s=options.timeout_s,
        drain_s=options.drain_s,
        extra=target.extra,
    )


def run_load(systems: list[str], options: LoadOptions, build: bool) -> dict:
    """Every system of ``systems`` (LOAD_SYSTEMS' names) in turn under the same schedule: its figures, or
    why it did not run."""
    model_dir, model_name = base_model_dir(options.base_model)
    pop, plans = population(options, model_name)
    arrivals = schedule(
        pop, rate=options.rate, count=options.count, duration_s=options.duration_s, zipf_s=options.zipf_s,
        base_share=0.0, seed=options.seed,
    )  # fmt: skip
    if not arrivals:
        raise ValueError("the schedule is empty: raise the rate, the duration or the count")
    rows: dict[str, dict] = {}
    not_run: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="lf-peers-load-") as tmp:
        adapters = PeerAdapters(plans, model_dir, options.seed, Path(tmp))
        for name in systems:
            progress(f"load: starting {name}")
            with ExitStack() as stack:
                try:
                    target = start(name, options, adapters, build, stack)
                except PeerUnavailable as e:
                    not_run[name] = str(e)
                    progress(f"load: {name} not run: {str(e).splitlines()[0]}")
                    continue
                progress(f"load: {name}: {len(arrivals)} requests at {options.rate}/s")
                outcomes, wall_s = asyncio.run(fire(target, arrivals, options))
            summary = summarize(outcomes, wall_s)
            rows[name] = {k: summary[k] for k in FIELDS}
            progress(f"load: {name}: {load_row(name, rows[name])}")
    return {
        "options": asdict(options),
        "model": model_name,
        "requests": len(arrivals),
        "distinct_adapters": len({a.model for a in arrivals}),
        "systems": rows,
        "not_run": not_run,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def load_row(name: str, row: dict) -> str:
    errors = f"{row['errors']} {row['errors_by_code']}" if row["errors"] else "0"
    lost = f"{row['lost']} {row['lost_by_reason']}" if row["lost"] else "0"
    return (
        f"| {name} | {row['requests']} | {row['completed']} | {errors} | {lost} "
        f"| {_ms(row['ttft_p50_ms'])} / {_ms(row['ttft_p95_ms'])} | {_ms(row['tpot_p50_ms'])} "
        f"| {row['throughput_tok_s']:.1f} |"
    )


def load_table(load: dict) -> str:
    """The issue's load table: one row per system, a not-run row for each that could not start."""
    o = load["options"]
    lines = [
        (
            f"Open loop, one system at a time: Poisson {o['rate']}/s for {o['duration_s']:.0f} s "
            f"({load['requests']} requests, seed {o['seed']}), {o['adapters']} rank-{RANK} q,v adapters "
            f"zipf({o['zipf_s']}) ({load['distinct_adapters']} asked for), {o['max_tokens']} tokens, streamed, "
            f"greedy; {load['model']} fp32."
        ),
        "",
        "| system | requests | completed | errors | lost | TTFT p50 / p95 ms | TPOT p50 ms | output tok/s |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    lines += [load_row(name, row) for name, row in load["systems"].items()]
    for name, reason in load["not_run"].items():
        lines.append(f"| {name} | not run: {reason.splitlines()[0][:200]} | | | | | | |")
    return "\n".join(lines)
