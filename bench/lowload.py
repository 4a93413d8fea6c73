"""One user, one chat: the whole stack's batch-1 TPOT and TTFT against the engine's own, in the same run.

``python -m bench.lowload [--dtype float32 bfloat16] [--rounds N] [--requests K] [--baseline DIR]
[--env K=V ...]``: per dtype, the stack of ``lorafleet up`` (nats-server, redis-server, the five
services, SmolLM2-135M in that dtype) with one rank-16 q,v adapter, and beside it, in this process, the
built-in engine on the same model, dtype and adapter. Each round runs K sequential streamed chat
requests of 64 tokens (greedy, EOS ignored) through the stack's HTTP API, and the same prompts one at
a time through the engine's step loop; the order of the systems rotates from round to round. Each
figure is the median over rounds of the round's median request (min and max beside it), and the
stack's TPOT is also a ratio to the engine's, round by round. The worker's own TPOT of the stack's
requests (from their audit records) splits the stack's time into the engine in the worker and the
path from its step thread to the client.

``--baseline DIR`` starts a second stack whose services run from the checkout at DIR (e.g. the main
branch), and each ``--variant NAME:K=V,K=V`` another stack of this checkout with those settings: all
run in the same rounds, so before/after figures are paired. Beside the times, the CPU each process
of a stack spent per token (from /proc, so a busy machine's waits do not count in it), and the
engine's own in this process.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import sqlite3
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx
import torch

from bench.engine import chat_ids
from bench.environment import environment
from bench.load.adapters import plan_adapters, register_adapters
from bench.load.client import send, send_raw
from bench.load.stack import BenchStack, create_tenants, start_stack, wait_keys
from bench.load.traffic import Arrival, prompt
from bench.multilora import random_weights
from bench.raw_http import RawStreamClient
from bench.rounds import DEFAULT_ROUNDS, Spread, spread
from kernels import omp_threads
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.async_engine import StepThread
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.quant import WeightFormat
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "lowload.json"
ClientKind = Literal["raw", "httpx"]
TENANT = "lowload-t0"
ADAPTER_RANK = 16
MAX_TOKENS = 64


@dataclass(slots=True)
class Served:
    """A started stack, its tenant's key and the adapter it serves."""

    name: str
    stack: BenchStack
    key: str
    adapter: str


@contextlib.contextmanager
def working_dir(directory: Path | None) -> Iterator[None]:
    """The services started inside run from ``directory``'s code (``python -m`` imports the cwd first)."""
    if directory is None:
        yield
        return
    before = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(before)


def start_served(name: str, dtype: str, checkout: Path | None, extra_env: dict[str, str]) -> Served:
    env = {"LF_ENGINE__DTYPE": dtype, **extra_env}
    with working_dir(checkout):
        stack = start_stack("smollm2", workers=1, request_timeout_s=120, extra_env=env)
    try:
        key, adapter = asyncio.run(_populate(stack))
    except BaseException:
        stack.stop(keep_logs=True)
        raise
    return Served(name, stack, key, adapter)


async def _populate(stack: BenchStack) -> tuple[str, str]:
    keys = await create_tenants(stack.nats_url, [TENANT])
    plans = plan_adapters(1, [TENANT], {ADAPTER_RANK: 1.0}, seed=3)
    await register_adapters(stack.nats_url, stack.model_dir, plans, concurrency=1, seed=3)
    await wait_keys(stack.url, keys)
    return keys[TENANT], plans[0].adapter_id


async def stack_round(served: Served, prompts: list[str], failures: list[str]) -> list[tuple[float, float]]:
    """(TTFT ms, TPOT ms) of each prompt through the stack's HTTP API (``chat_round``)."""
    return await chat_round(served.name, served.stack.url, served.key, served.adapter, prompts, failures)


async def chat_round(
    name: str,
    url: str,
    key: str,
    model: str,
    prompts: list[str],
    failures: list[str],
    extra: dict | None = None,
    client: ClientKind = "raw",
) -> list[tuple[float, float]]:
    """(TTFT ms, TPOT ms) of each prompt, sent one after the other as streamed requests to an OpenAI chat
    API over one keep-alive connection; a request that fails (e.g. worker_lost on an overloaded machine)
    is noted in ``failures`` and sent again. ``client`` "raw" is ``bench.raw_http``'s (prebuilt bytes:
    on this 2-core box httpx spent 0.6-0.7 ms of CPU per streamed token beside the server), "httpx" the
    load client's."""
    figures = []
    parts = urlsplit(url)
    raw = RawStreamClient(parts.hostname or "127.0.0.1", parts.port or 80, {"Authorization": f"Bearer {key}"})
    web = httpx.AsyncClient(base_url=url, timeout=120) if client == "httpx" else None
    try:
        for i, text in enumerate(prompts):
            for _ in range(3):
                arrival = Arrival(i, 0.0, TENANT, model, text)
                if web is None:
                    out = await send_raw(raw, arrival, max_tokens=MAX_TOKENS, timeout_s=120, extra=extra)
                else:
                    out = await send(web, key, arrival, max_tokens=MAX_TOKENS, timeout_s=120, extra=extra)
                if out.status == "completed" and out.tokens == MAX_TOKENS and out.tpot_ms and out.ttft_ms:
                    figures.append((out.ttft_ms, out.tpot_ms))
                    break
                failures.append(f"{out.status}:{out.code}:{out.tokens}")
            else:
                raise RuntimeError(f"{name}: request {i} failed three times: {failures[-3:]}")
    finally:
        await raw.close()
        if web is not None:
            await web.aclose()
    return figures


class EngineAlone:
    """The built-in engine in this process, on the worker's engine defaults, one request at a time, on a
    StepThread as the worker's (loaded, built and stepped there, reniced, this process's one OpenMP team)."""

    def __init__(self, dtype: str, weights: WeightFormat = "none"):
        config = EngineConfig(dtype=dtype, weights=weights)
        # loaded, built and stepped on one thread, the process's one OpenMP team, as in the worker
        self.thread = StepThread(config, omp_threads.serial_process())
        self.loaded, self.engine = self.thread.submit(lambda: self._build(config)).result()
        self.count = 0

    @staticmethod
    def _build(config: EngineConfig) -> tuple[LoadedModel, LLMEngine]:
        dtype = getattr(torch, config.dtype)
        loaded = load_model(dtype=dtype)
        shapes = ModelShapes.from_hf_config(loaded.model.config)
        manager = AdapterManager(LoraConfig(), shapes, dtype=dtype)
        manager.load_adapter("a", random_weights(shapes, ADAPTER_RANK, 3))
        return loaded, LLMEngine.from_loaded(loaded, config, manager)

    def round(self, prompts: list[str]) -> list[tuple[float, float]]:
        return self.thread.submit(lambda: self._round(prompts)).result()

    def _round(self, prompts: list[str]) -> list[tuple[float, float]]:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        figures = []
        for text in prompts:
            self.count += 1
            ids = chat_ids(self.loaded.tokenizer, text)
            start = time.monotonic()
            self.engine.add_request(EngineRequest(f"r{self.count}", ids, params, adapter="a"))
            first = last = None
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.token_ids:
                        last = time.monotonic()
                        first = first or last
            assert first is not None and last is not None
            figures.append(((first - start) * 1000, (last - first) * 1000 / (MAX_TOKENS - 1)))
        return figures


def worker_tpots(served: Served, skip: int) -> list[float]:
    """The worker's own TPOT (first to last token out of its engine) of each completed request, in order."""
    db = served.stack.root / "audit.sqlite3"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT body FROM audit WHERE kind = 'completion' ORDER BY pos").fetchall()
    return [json.loads(body)["tpot_ms"] for (body,) in rows][skip:]


def cpu_s(stat: Path) -> float:
    """User + system CPU seconds so far of a process (``/proc/PID/stat``: all its threads) or a thread."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_process(stack: BenchStack) -> dict[str, float]:
    """CPU seconds of each of the stack's processes and of this one (the client); the worker's also
    split into its event loop (the main thread: replies, NATS) and the rest (the engine's threads)."""
    spent = {name: cpu_s(Path(f"/proc/{pid}/stat")) for name, pid in stack.pids().items()}
    worker = stack.pids()["worker"]
    loop = cpu_s(Path(f"/proc/{worker}/task/{worker}/stat"))
    return spent | {
        "worker event loop": loop,
        "worker engine threads": spent["worker"] - loop,
        "client": cpu_s(Path(f"/proc/{os.getpid()}/stat")),
    }


def median_of(figures: list[tuple[float, float]], which: int) -> float:
    return statistics.median(f[which] for f in figures)


def run_dtype(
    dtype: str,
    rounds: int,
    requests: int,
    baseline: Path | None,
    extra_env: dict[str, str],
    variants: dict[str, dict[str, str]],
) -> dict:
    systems: list[Served] = []
    alone: EngineAlone | None = None
    try:
        systems.append(start_served("stack", dtype, None, extra_env))
        if baseline is not None:
            systems.append(start_served("baseline", dtype, baseline, extra_env))
        for name, env in variants.items():
            systems.append(start_served(name, dtype, None, env))
        alone = EngineAlone(dtype)
        rng = random.Random(0)
        warm = [prompt(rng) for _ in range(2)]
        for served in systems:
            asyncio.run(stack_round(served, warm, []))
        alone.round(warm)
        names = [s.name for s in systems] + ["engine"]
        per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in names}  # (TTFT, TPOT) ms
        cpu: dict[str, dict[str, float]] = {name: {} for name in names}  # process -> CPU s, summed
        failures: dict[str, list[str]] = {name: [] for name in names}
        for r in range(rounds):
            prompts = [prompt(rng) for _ in range(requests)]
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name == "engine":
                    before = {"engine": time.process_time()}
                    figures = alone.round(prompts)
                    after = {"engine": time.process_time()}
                else:
                    served = next(s for s in systems if s.name == name)
                    before = cpu_by_process(served.stack)
                    figures = asyncio.run(stack_round(served, prompts, failures[name]))
                    after = cpu_by_process(served.stack)
                for process, spent in after.items():
                    cpu[name][process] = cpu[name].get(process, 0.0) + spent - before[process]
                per_round[name].append((median_of(figures, 0), median_of(figures, 1)))
            print(
                f"  {dtype} round {r + 1}: " + ", ".join(f"{n} TPOT {per_round[n][-1][1]:.2f} ms" for n in names),
                flush=True,
            )
        time.sleep(2)  # the last audit records reach the auditor's database
        result: dict = {"systems": {}}
        engine_tpot = [f[1] for f in per_round["engine"]]
        for name in names:
            ttft, tpot = [f[0] for f in per_round[name]], [f[1] for f in per_round[name]]
            tokens = rounds * requests * MAX_TOKENS
            row: dict = {
                "ttft_ms": spread(ttft),
                "tpot_ms": spread(tpot),
                "cpu_ms_per_token": {p: round(s * 1000 / tokens, 3) for p, s in cpu[name].items()},
                "failed_requests": failures[name],
            }
            if name != "engine":
                row["tpot_vs_engine"] = spread([a / b for a, b in zip(tpot, engine_tpot, strict=True)])
                served = next(s for s in systems if s.name == name)
                inside = worker_tpots(served, skip=len(warm))
                if inside:
                    row["worker_tpot_ms"] = spread(inside)
            result["systems"][name] = row
        for name in names[1:-1]:
            paired = zip(per_round["stack"], per_round[name], strict=True)
            result["systems"][name]["stack_vs_this_tpot"] = spread([a[1] / b[1] for a, b in paired])
        return result
    finally:
        for served in systems:
            served.stack.stop()
        if alone is not None:
            alone.thread.close()


def fmt(s: Spread) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def table(results: dict[str, dict]) -> str:
    rows = [
        "| dtype | system | TTFT ms | TPOT ms | TPOT / engine | worker's own TPOT ms |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for dtype, result in results.items():
        for name, row in result["systems"].items():
            ratio = fmt(row["tpot_vs_engine"]) if "tpot_vs_engine" in row else "1"
            inside = fmt(row["worker_tpot_ms"]) if "worker_tpot_ms" in row else "-"
            rows.append(f"| {dtype} | {name} | {fmt(row['ttft_ms'])} | {fmt(row['tpot_ms'])} | {ratio} | {inside} |")
    rows += ["", "CPU ms per token, by process:", ""]
    for dtype, result in results.items():
        for name, row in result["systems"].items():
            spent = ", ".join(f"{p} {ms:.2f}" for p, ms in sorted(row["cpu_ms_per_token"].items(), key=lambda i: -i[1]))
            rows.append(f"- {dtype} {name}: {spent}")
    return "\n".join(rows)


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME:K=V,K=V`` -> (NAME, {K: V}); ValueError for a spec without a name or a setting without ``=``."""
    name, _, settings = spec.partition(":")
    items = [item for item in settings.split(",") if item]
    if not name or name in ("stack", "baseline", "engine") or any("=" not in item for item in items):
        raise ValueError(f"bad variant {spec!r}: want NAME:K=V,K=V with a NAME other than stack, baseline, engine")
    return name, dict(item.split("=", 1) for item in items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--requests", type=int, default=3, help="sequential requests per system per round")
    parser.add_argument(
        "--baseline", type=Path, help="a checkout whose services run as a second, paired stack (same --env)"
    )
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="for the stack's services")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="NAME:K=V,K=V", help="another stack with these settings"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    extra_env = dict(item.split("=", 1) for item in args.env)
    variants = dict(map(parse_variant, args.variant))
    results = {}
    for dtype in args.dtype:
        print(f"{dtype}: starting", flush=True)
        results[dtype] = run_dtype(dtype, args.rounds, args.requests, args.baseline, extra_env, variants)
    payload = {
        "environment": environment(torch.get_num_threads()),
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "max_tokens": MAX_TOKENS,
        "baseline": str(args.baseline) if args.baseline else None,
        "env": extra_env,
        "variants": variants,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    markdown = table(results)
    args.out.with_suffix(".md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
