"""The worker's two engines side by side: built-in vs vLLM, on bench.multilora's workload.

``python -m bench.engine_peers [--quick] [--model smollm2|tiny] [--batches 1 8 32] [--rounds N] [--threads N]``:
each engine runs in a process of its own behind the worker's engine port (bench/engine_peer.py; vLLM's
with .venv-vllm's interpreter), both with the same pinned thread count, on the same model, dtype, chat
prompts (20-60 tokens), adapters and token counts, greedy, EOS ignored, prefix caching off. Per batch
size: base, each request on its own random rank-16 q,v adapter, and the same on all seven projections.
5 rounds (3 with --quick); the two systems alternate within every round (the first to run switches
each time); each figure is the median round, min and max beside it. The machine's roofline is
measured and printed first (bench/roofline.py): every decode step is also compared with its floor.
The headlines, at the top of the JSON: batch1_tpot_ratio_vs_vllm (built-in / vLLM base TPOT p50 at
the smallest batch) and multilora_speedup_vs_vllm (built-in / vLLM q,v multi-LoRA tok/s at the largest).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, TypedDict, cast

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.engine import STYLES, TOPICS, chat_ids
from bench.engine_peer import READY, RESULT, Job, Spec
from bench.environment import environment, rounds_argument, threads_argument
from bench.load.stack import base_model_dir
from bench.multilora import QV, RANK, save_adapters
from bench.roofline import Limits, LimitsProbe, roofline, roofline_line, step_floor_ms, weights_of
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS, Run, Summary, spread_text, summarise
from services.worker.lora import MODULES

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "engine_peers.json"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SYSTEMS = ("builtin", "vllm")
WORKLOADS = {"base": (), "qv": QV, "all": MODULES}  # workload -> target modules of its adapters


class Row(TypedDict):
    batch: int
    workload: str
    systems: dict[str, Summary]
    step_floor_ms: float
    tpot_vs_floor: dict[str, float]
    ratio_vs_base: dict[str, float]
    builtin_vs_vllm: dict[str, float]


class Peer:
    """One engine process: a job line in, a Run line out."""

    def __init__(self, kind: str, spec: Spec, log: IO[str]):
        python = str(VLLM_PYTHON) if kind == "vllm" else sys.executable
        # OMP_NUM_THREADS sets torch's intra-op threads in both peers (vLLM's engine core included)
        threads = str(spec["threads"])
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": threads}
        self.kind = kind
        self.log = log
        self.proc = subprocess.Popen(
            [python, "-m", "bench.engine_peer", kind, json.dumps(spec)],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        self.start_s: float = self._answer(READY)["start_s"]

    def run(self, job: Job) -> Run:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return cast(Run, self._answer(RESULT))  # the peer prints a bench.engine.Run

    def peak_rss_mb(self) -> float:
        """Sum of each process's peak RSS (VmHWM) in the peer's tree: vLLM's engine core is a child."""
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        total = 0
        for p in procs:
            status = Path(f"/proc/{p.pid}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
        return total / 1024

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _answer(self, prefix: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return json.loads(line.removeprefix(prefix))
        self.log.flush()
        tail = Path(self.log.name).read_text()[-4000:]
        raise RuntimeError(
            f"the {self.kind} peer exited ({self.proc.wait()}) without answering (its log: {self.log.name}; "
            f"a killed vLLM worker process may be the kernel's OOM killer, see dmesg):\n{tail}"
        )


@contextmanager
def peers(spec: Spec, logs: Path) -> Iterator[dict[str, Peer]]:
    """Both engines, started one after the other (each loads alone)."""
    with ExitStack() as stack:
        started = {}
        for kind in SYSTEMS:
            log = stack.enter_context(open(logs / f"{kind}.log", "w"))
            started[kind] = Peer(kind, spec, log)
            stack.callback(started[kind].close)
        yield started


def jobs(batch: int, prompts: list[list[int]], new_tokens: int) -> dict[str, Job]:
    """Per workload: the first ``batch`` prompts, each on its own adapter of that workload's set."""
    chosen = prompts[:batch]
    return {
        workload: {
            "prompts": chosen,
            "adapters": [f"{workload}{i}" if modules else None for i in range(batch)],
            "max_tokens": new_tokens,
        }
        for workload, modules in WORKLOADS.items()
    }


def measure(
    running: dict[str, Peer],
    batches: list[int],
    prompts: list[list[int]],
    new_tokens: int,
    rounds: int,
    probe: LimitsProbe,
) -> dict[tuple[int, str], dict[str, list[Run]]]:
    """Every (batch, workload) job on both peers once per round, the first to run alternating; the
    machine's limits probed after each round (the peers idle meanwhile)."""
    for job in jobs(max(batches), prompts, 2).values():  # warm-up: first use of every path and slot
        for peer in running.values():
            peer.run(job)
    runs: dict[tuple[int, str], dict[str, list[Run]]] = {}
    turn = 0
    for _ in range(rounds):
        for batch in batches:
            for workload, job in jobs(batch, prompts, new_tokens).items():
                order = SYSTEMS if turn % 2 == 0 else SYSTEMS[::-1]
                turn += 1
                for kind in order:
                    run = running[kind].run(job)
                    runs.setdefault((batch, workload), {k: [] for k in SYSTEMS})[kind].append(run)
                    progress(f"batch {batch} {workload} {kind}: {run['wall_s']:.1f} s")
        probe.sample()
    return runs


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rows_of(runs: dict[tuple[int, str], dict[str, list[Run]]], limits: Limits, new_tokens: int) -> list[Row]:
    summaries = {key: {k: summarise(r, key[0] * new_tokens) for k, r in by.items()} for key, by in runs.items()}
    rows: list[Row] = []
    for (batch, workload), systems in summaries.items():
        floor = step_floor_ms(limits, batch)
        base = summaries[(batch, "base")]
        b, v = systems["builtin"], systems["vllm"]
        rows.append(
            {
                "batch": batch,
                "workload": workload,
                "systems": systems,
                "step_floor_ms": floor,
                "tpot_vs_floor": {k: s["tpot_ms"]["p50"] / floor for k, s in systems.items()},
                "ratio_vs_base": {k: s["tok_s"] / base[k]["tok_s"] for k, s in systems.items()},
                "builtin_vs_vllm": {
                    "tok_s": b["tok_s"] / v["tok_s"],
                    "ttft_p50": v["ttft_ms"]["p50"] / b["ttft_ms"]["p50"],
                    "tpot_p50": v["tpot_ms"]["p50"] / b["tpot_ms"]["p50"],
                },
            }
        )
    return rows


def headlines(rows: list[Row]) -> dict[str, object]:
    """Built-in / vLLM base TPOT p50 at the smallest batch, and q,v multi-LoRA tok/s at the largest
    (1 and 32 in the full run), from the median rounds."""
    by = {(r["batch"], r["workload"]): r["systems"] for r in rows}
    small, large = min(b for b, _ in by), max(b for b, _ in by)
    base, multi = by[(small, "base")], by[(large, "qv")]
    return {
        "batch1_tpot_ratio_vs_vllm": base["builtin"]["tpot_ms"]["p50"] / base["vllm"]["tpot_ms"]["p50"],
        "multilora_speedup_vs_vllm": multi["builtin"]["tok_s"] / multi["vllm"]["tok_s"],
        "headline_batches": {"batch1_tpot_ratio_vs_vllm": small, "multilora_speedup_vs_vllm": large},
    }


def table(result: dict) -> str:
    lines = [
        f"Median of {result['rounds']} rounds (min-max)",
        "",
        "| batch | workload | system | tok/s median (min-max) | vs base | TTFT p50 / p95 ms | "
        "TPOT p50 ms median (min-max) | TPOT p95 ms | TPOT / floor |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for kind, s in row["systems"].items():
            lines.append(
                f"| {row['batch']} | {row['workload']} | {kind} | {spread_text(s['spread']['tok_s'])} | "
                f"{row['ratio_vs_base'][kind]:.2f} | {s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p95']:.0f} | "
                f"{spread_text(s['spread']['tpot_p50_ms'])} | {s['tpot_ms']['p95']:.1f} | "
                f"{row['tpot_vs_floor'][kind]:.1f}x |"
            )
    lines += ["", "| batch | workload | builtin / vllm tok/s | vllm / builtin TTFT p50 | vllm / builtin TPOT p50 |"]
    lines.append("|---:|---|---:|---:|---:|")
    for row in result["rows"]:
        r = row["builtin_vs_vllm"]
        lines.append(
            f"| {row['batch']} | {row['workload']} | {r['tok_s']:.2f}x | {r['ttft_p50']:.2f}x | {r['tpot_p50']:.2f}x |"
        )
    limits, systems = result["limits"], result["systems"]
    lines += [
        "",
        f"Machine: read {limits['read_gb_s']:.1f} GB/s, GEMM {limits['gemm_gflop_s']:.0f} GFLOP/s "
        f"({result['dtype']}); weights {limits['weight_mb']:.0f} MB. Step floors: "
        + ", ".join(f"batch {row['batch']} {row['step_floor_ms']:.1f} ms" for row in result["rows"][::3]),
        "Peak RSS (process tree): "
        + ", ".join(f"{k} {s['peak_rss_mb']:.0f} MB (ready in {s['start_s']:.0f} s)" for k, s in systems.items()),
        "",
        f"Headline: built-in / vLLM base TPOT p50 at batch {result['headline_batches']['batch1_tpot_ratio_vs_vllm']} "
        f"= {result['batch1_tpot_ratio_vs_vllm']:.2f}x; multi-LoRA tok/s at batch "
        f"{result['headline_batches']['multilora_speedup_vs_vllm']} = {result['multilora_speedup_vs_vllm']:.2f}x",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_peers", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"tiny sizes: batches 1 and 4, 4 tokens, {QUICK_ROUNDS} rounds"
    )
    parser.add_argument(
        "--model", choices=("smollm2", "tiny-h64"), default="smollm2", help="base model (tiny-h64: 2-layer, for tests)"
    )
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request (default 32)")
    rounds_argument(parser)
    threads_argument(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of both engines")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        parser.error(f"{VLLM_PYTHON} is missing: run `make venv-vllm`")
    batches = args.batches or ([1, 4] if args.quick else [1, 8, 32])
    new_tokens = args.new_tokens or (4 if args.quick else 32)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    torch.set_num_threads(args.threads)
    model_dir, model_name = base_model_dir(args.model)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)]) for i in range(max(batches))]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    probe = LimitsProbe(weights_of(model), dtype)
    print(roofline_line(probe.limits(), args.dtype, args.threads), flush=True)
    with tempfile.TemporaryDirectory(prefix="lf-engine-peers-") as tmp:
        root = Path(tmp)
        adapters: dict[str, str] = {}
        for workload, modules in WORKLOADS.items():
            if modules:
                names = [f"{workload}{i}" for i in range(max(batches))]
                dirs = save_adapters(model, names, modules, root / workload)
                adapters |= {n: str(d) for n, d in zip(names, dirs, strict=True)}
        del model
        spec: Spec = {
            "model_dir": str(model_dir),
            "dtype": args.dtype,
            "max_batch": max(batches),
            "adapters": adapters,
            "scratch": str(root),
            "threads": args.threads,
        }
        progress(f"{len(adapters)} adapters saved; starting the engines")
        logs = Path(tempfile.mkdtemp(prefix="lf-engine-peers-logs-"))  # kept when an engine fails
        with peers(spec, logs) as running:
            progress(", ".join(f"{k} ready in {p.start_s:.0f} s" for k, p in running.items()))
            runs = measure(running, batches, prompts, new_tokens, rounds, probe)
            systems = {k: {"peak_rss_mb": p.peak_rss_mb(), "start_s": p.start_s} for k, p in running.items()}
    shutil.rmtree(logs)
    limits = probe.limits()  # every batch runs in every round: one window, the whole run
    print(probe.line(), flush=True)
    rows = rows_of(runs, limits, new_tokens)
    result = {
        **headlines(rows),
        "environment": {**environment(args.threads, args.dtype), "model": model_name},
        "quick": args.quick,
        "dtype": args.dtype,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "headline": "median",
        "batches": batches,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "adapters": {w: max(batches) for w, m in WORKLOADS.items() if m},
        "rank_mix": {str(RANK): len(adapters)},
        "target_modules": {w: list(m) for w, m in WORKLOADS.items() if m},
        "limits": limits,
        "roofline": roofline(limits),
        "roofline_probes": probe.spread(),
        "systems": systems,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
