"""One user, one chat, against the peers: lorafleet's whole stack, its engine alone, llama.cpp's ``llama-server``
and ``vllm serve``, batch-1 TPOT and TTFT per precision, all in the same rounds.

``python -m bench.peers_stack [--precision fp32 bf16] [--int8] [--rounds N] [--requests K] [--systems ...]
[--no-build]``: per precision, the stack of ``lorafleet up`` and the built-in engine in this process as
bench.lowload starts them, llama-server (bench/peers_build.py builds it once; the model converted to GGUF
f32 / bf16 / Q8_0, the adapter preloaded, applied per request with ``lora``, its global scale set to 0) and
vLLM's CPU build (``--enable-lora``, the adapter in ``--lora-modules``), all serving the same rank-16 q,v
adapter (the one bench.lowload registers) on SmolLM2-135M. Each round sends K sequential streamed chat
requests of 64 tokens (greedy, EOS ignored) to each system, the order rotating from round to round; each
figure is the median over rounds of the round's median request (min and max beside it), and every peer's
TPOT is also set against lorafleet's, round by round. ``--int8`` adds lorafleet with LF_ENGINE__WEIGHTS=int8
(bf16 activations) against llama.cpp's Q8_0. Before the rounds, each peer's greedy answer to the first
prompt is compared with lorafleet's (reported, not asserted). A peer that cannot start gets a row saying
why, never figures.

``--load [--load-rate R] [--load-duration-s S] [--load-count N] [--load-adapters A]`` runs the open-loop load
table instead (bench/peers_load.py: lorafleet, vLLM and llama.cpp one after another under the same schedule,
fp32); it is written under ``load`` in the same JSON and Markdown, beside the batch-1 figures already there.
"""

import argparse
import asyncio
import json
import os
import random
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.environment import environment
from bench.load.adapters import write_adapter
from bench.load.stack import base_model_dir
from bench.load.traffic import prompt
from bench.lowload import MAX_TOKENS, EngineAlone, Served, chat_round, median_of, stack_round, start_served
from bench.peer_servers import PeerServer, agreement, greedy_text, start_llama, start_vllm
from bench.peers_build import PeerUnavailable, adapter_gguf, llama_server, model_gguf
from bench.peers_load import LOAD_SYSTEMS, LoadOptions, load_table, run_load
from bench.rounds import DEFAULT_ROUNDS, Spread, spread, spread_text
from services.worker.engine.quant import WeightFormat
from shared.fingerprint import BaseModelSpec

RESULTS = Path(__file__).parent / "results" / "peers_stack.json"
SYSTEMS = ("lorafleet", "engine", "llama.cpp", "vllm")
ADAPTER_SEED = 3  # bench.lowload registers adapter 0 of seed 3: write_adapter(..., seed 3 + 0)
CHECK_TOKENS = 24
LOAD_DEFAULTS = LoadOptions()

Figures = list[tuple[float, float]]  # (TTFT ms, TPOT ms) per request


@dataclass(frozen=True, slots=True)
class Precision:
    dtype: str  # lorafleet's and vLLM's LF_ENGINE__DTYPE / --dtype
    weights: WeightFormat  # lorafleet's LF_ENGINE__WEIGHTS
    gguf: str  # llama.cpp's model type
    lora_gguf: str  # llama.cpp's adapter type


PRECISIONS = {
    "fp32": Precision("float32", "none", "f32", "f32"),
    "bf16": Precision("bfloat16", "none", "bf16", "bf16"),
    "int8": Precision("bfloat16", "int8", "q8_0", "bf16"),
}


class Started:
    """The systems of one precision that did start, each as a round runner, and why the others did not."""

    def __init__(self) -> None:
        self.runners: dict[str, Callable[[list[str]], Figures]] = {}
        self.not_run: dict[str, str] = {}
        self.failures: dict[str, list[str]] = {}
        self.greedy: dict[str, dict] = {}


def start_systems(name: str, systems: list[str], build: bool, work: Path, stack: ExitStack) -> Started:
    p = PRECISIONS[name]
    started = Started()
    model_dir, _ = base_model_dir("smollm2")
    threads = len(os.sched_getaffinity(0))
    served: Served | None = None
    if "lorafleet" in systems:
        env: dict[str, str] = {} if p.weights == "none" else {"LF_ENGINE__WEIGHTS": str(p.weights)}
        served = start_served("lorafleet", p.dtype, None, env)
        stack.callback(served.stack.stop)
        started.runners["lorafleet"] = _stack_runner(served, started.failures.setdefault("lorafleet", []))
    if "engine" in systems:
        alone = EngineAlone(p.dtype, p.weights)
        stack.callback(alone.thread.close)
        started.runners["engine"] = alone.round
    adapter_name = served.adapter if served else "lowload-adapter"
    adapter_dir = write_adapter(work / "adapter", BaseModelSpec.from_model_dir(model_dir), 16, ADAPTER_SEED)
    peers: list[PeerServer] = []
    if "llama.cpp" in systems:
        try:
            binary = llama_server(build=build)
            gguf = model_gguf(model_dir, p.gguf)
            lora = adapter_gguf(adapter_dir, model_dir, p.lora_gguf, work / f"adapter-{p.lora_gguf}.gguf")
            peers.append(start_llama(binary, gguf, [lora], threads, work / f"llama-{name}.log"))
        except PeerUnavailable as e:
            started.not_run["llama.cpp"] = str(e)
    if "vllm" in systems:
        if p.weights != "none":
            started.not_run["vllm"] = "no weight-only int8 checkpoint of the model for vLLM in this bench"
        else:
            try:
                peers.append(start_vllm(model_dir, {adapter_name: adapter_dir}, p.dtype, threads, work / "vllm.log"))
            except PeerUnavailable as e:
                started.not_run["vllm"] = str(e)
    for peer in peers:
        stack.callback(peer.stop)
        started.runners[peer.name] = _peer_runner(peer, started.failures.setdefault(peer.name, []))
    if served is not None:
        started.greedy = asyncio.run(_greedy_check(served, peers))
    return started


def _stack_runner(served: Served, fails: list[str]) -> Callable[[list[str]], Figures]:
    def run(prompts: list[str]) -> Figures:
        return asyncio.run(stack_round(served, prompts, fails))

    return run


def _peer_runner(peer: PeerServer, fails: list[str]) -> Callable[[list[str]], Figures]:
    def run(prompts: list[str]) -> Figures:
        return asyncio.run(chat_round(peer.name, peer.url, "none", peer.model, prompts, fails, peer.extra))

    return run


async def _greedy_check(served: Served, peers: list[PeerServer]) -> dict[str, dict]:
    """Each peer's greedy answer to one prompt against lorafleet's, word by word (like for like, not asserted)."""
    text = prompt(random.Random(0))
    reference = await greedy_text(served.stack.url, served.adapter, text, CHECK_TOKENS, served.key)
    result = {"lorafleet": {"text": reference}}
    for peer in peers:
        answer = await greedy_text(peer.url, peer.model, text, CHECK_TOKENS, extra=peer.extra)
        result[peer.name] = agreement(reference, answer)
    return result


def measure(started: Started, rounds: int, requests: int, rng: random.Random, label: str) -> dict[str, Figures]:
    """Per system, the (median TTFT, median TPOT) of each round; the first to run rotates. A system whose
    requests keep failing leaves the run with its reason in ``not_run`` (no partial figures)."""
    names = list(started.runners)
    warm = [prompt(rng) for _ in range(2)]
    for name in names:
        _attempt(started, name, warm, "warming up")
    per_round: dict[str, Figures] = {name: [] for name in names}
    for r in range(rounds):
        prompts = [prompt(rng) for _ in range(requests)]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name in started.runners and (figures := _attempt(started, name, prompts, f"round {r + 1}")):
                per_round[name].append((median_of(figures, 0), median_of(figures, 1)))
        done = ", ".join(f"{n} {per_round[n][-1][1]:.2f}" for n in names if n in started.runners)
        print(f"  {label} round {r + 1} TPOT ms: {done}", flush=True)
    return {name: figures for name, figures in per_round.items() if name in started.runners}


def _attempt(started: Started, name: str, prompts: list[str], when: str) -> Figures | None:
    try:
        return started.runners[name](prompts)
    except RuntimeError as e:  # chat_round's: a request failed three times
        started.not_run[name] = f"failed {when}: {e}"
        del started.runners[name]
        return None


def summarise(started: Started, per_round: dict[str, Figures]) -> dict:
    """Spreads over the rounds; lorafleet's TPOT over each system's, paired round by round (< 1: lorafleet faster)."""
    systems: dict[str, dict] = {}
    ours = [f[1] for f in per_round.get("lorafleet", [])]
    for name, figures in per_round.items():
        tpot = [f[1] for f in figures]
        row: dict = {
            "ttft_ms": spread([f[0] for f in figures]),
            "tpot_ms": spread(tpot),
            "failed_requests": started.failures.get(name, []),
        }
        if ours and name != "lorafleet":
            row["lorafleet_tpot_over_this"] = spread([a / b for a, b in zip(ours, tpot, strict=True)])
        systems[name] = row
    return {"systems": systems, "not_run": started.not_run, "greedy": started.greedy}


def run_precision(name: str, systems: list[str], rounds: int, requests: int, build: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"lf-peers-{name}-") as tmp, ExitStack() as stack:
        started = start_systems(name, systems, build, Path(tmp), stack)
        per_round = measure(started, rounds, requests, random.Random(1), name)
        return summarise(started, per_round)


def cell(s: Spread | None) -> str:
    return spread_text(s, 2) if s else "-"


def table(results: dict[str, dict]) -> str:
    """The issue's TPOT table (one row per precision), then every system's figures and the greedy check."""
    lines = [
        "| precision | " + " | ".join(f"{n} TPOT ms" for n in SYSTEMS) + " |",
        "|---|" + "---:|" * len(SYSTEMS),
    ]
    for precision, result in results.items():
        cells = []
        for n in SYSTEMS:
            row = result["systems"].get(n)
            cells.append(f"{row['tpot_ms']['median']:.2f}" if row else "not run" if n in result["not_run"] else "-")
        lines.append(f"| {precision} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| precision | system | TTFT ms median (min-max) | TPOT ms median (min-max) | lorafleet TPOT / this |",
        "|---|---|---:|---:|---:|",
    ]
    for precision, result in results.items():
        for n, row in result["systems"].items():
            ratio = cell(row.get("lorafleet_tpot_over_this")) if n != "lorafleet" else "1"
            lines.append(f"| {precision} | {n} | {cell(row['ttft_ms'])} | {cell(row['tpot_ms'])} | {ratio} |")
        for n, reason in result["not_run"].items():
            lines.append(f"| {precision} | {n} | not run: {reason.splitlines()[0][:200]} | | |")
    lines += ["", f"Greedy answers to the same prompt ({CHECK_TOKENS} tokens) against lorafleet's:", ""]
    for precision, result in results.items():
        for n, check in result["greedy"].items():
            if n != "lorafleet":
                same = (
                    "identical" if check["identical"] else f"first {check['same_words']} of {check['of_words']} words"
                )
                lines.append(f"- {precision} {n}: {same}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers_stack", description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=("fp32", "bf16"))
    parser.add_argument("--int8", action="store_true", help="also lorafleet int8 weights against llama.cpp Q8_0")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--requests", type=int, default=3, help="sequential requests per system per round")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--no-build", action="store_true", help="never build llama-server (its row says so)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    load = parser.add_argument_group("the open-loop load table (instead of the batch-1 rounds)")
    load.add_argument("--load", action="store_true", help="lorafleet, vllm and llama.cpp under open-loop load")
    load.add_argument("--load-rate", type=float, default=LOAD_DEFAULTS.rate, help="requests/s, Poisson")
    load.add_argument("--load-duration-s", type=float, default=LOAD_DEFAULTS.duration_s)
    load.add_argument("--load-count", type=int, default=LOAD_DEFAULTS.count, help="at most this many requests")
    load.add_argument("--load-adapters", type=int, default=LOAD_DEFAULTS.adapters, help="rank-16 q,v, zipf(1.1)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.requests < 1:
        parser.error("--rounds and --requests must be at least 1")
    if args.load_rate <= 0 or args.load_duration_s <= 0 or args.load_count < 1 or args.load_adapters < 1:
        parser.error("--load-rate, --load-duration-s, --load-count and --load-adapters must be positive")
    args.precisions = args.precision + (["int8"] if args.int8 else [])
    return args


def load_options(args: argparse.Namespace) -> LoadOptions:
    return LoadOptions(
        rate=args.load_rate, duration_s=args.load_duration_s, count=args.load_count, adapters=args.load_adapters
    )


def write(out: Path, payload: dict) -> str:
    """The JSON, keeping the part (batch-1 results or ``load``) this run did not measure; the Markdown of both."""
    if out.exists():
        payload = json.loads(out.read_text()) | payload
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    parts = [table(payload["results"])] if payload.get("results") else []
    parts += [load_table(payload["load"])] if payload.get("load") else []
    markdown = "\n\n".join(parts)
    out.with_suffix(".md").write_text(markdown + "\n")
    return markdown


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    environment_now = environment(torch.get_num_threads())
    if args.load:
        systems = [name for name in LOAD_SYSTEMS if name in args.systems]
        load = run_load(systems, load_options(args), not args.no_build)
        print(write(args.out, {"load": load | {"environment": environment_now}}))
        return
    results = {}
    for name in args.precisions:
        print(f"{name}: starting {', '.join(args.systems)}", flush=True)
        results[name] = run_precision(name, args.systems, args.rounds, args.requests, not args.no_build)
    payload = {
        "environment": environment_now,
        "rounds": args.rounds,
        "requests_per_round": args.requests,
        "max_tokens": MAX_TOKENS,
        "precisions": {
            n: {"dtype": PRECISIONS[n].dtype, "weights": PRECISIONS[n].weights, "gguf": PRECISIONS[n].gguf}
            for n in args.precisions
        },
        "results": results,
    }
    print(write(args.out, payload))


if __name__ == "__main__":
    main()
