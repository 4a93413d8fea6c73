"""The worker's two engines side by side: built-in vs vLLM, on bench.multilora's workload.

``python -m bench.engine_peers [--quick] [--model smollm2|tiny] [--batches 1 8 32]``: each engine runs in
a process of its own behind the worker's engine port (bench/engine_peer.py; vLLM's with .venv-vllm's
interpreter), on the same model, dtype, chat prompts (20-60 tokens), adapters and token counts, greedy,
EOS ignored, prefix caching off. Per batch size: base, each request on its own random rank-16 q,v
adapter, and the same on all seven projections. The two systems alternate within every repetition
(the first to run switches each time); best repetition reported. The machine's limits are measured
first: every decode step is also compared with its floor (weight bytes / read bandwidth, or
2 x params x batch / GEMM FLOP/s, whichever is larger).
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

from bench.engine import STYLES, TOPICS, Run, Summary, chat_ids, environment, summarise
from bench.engine_peer import READY, RESULT, Job, Spec
from bench.load.stack import base_model_dir
from bench.multilora import QV, RANK, save_adapters
from services.worker.lora import MODULES

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "engine_peers.json"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SYSTEMS = ("builtin", "vllm")
WORKLOADS = {"base": (), "qv": QV, "all": MODULES}  # workload -> target modules of its adapters


class Limits(TypedDict):
    read_gb_s: float
    gemm_gflop_s: float
    weight_mb: float
    params: int


class Row(TypedDict):
    batch: int
    workload: str
    systems: dict[str, Summary]
    step_floor_ms: float
    tpot_vs_floor: dict[str, float]
    ratio_vs_base: dict[str, float]
    builtin_vs_vllm: dict[str, float]


def machine_limits(weights: list[torch.Tensor], dtype: torch.dtype) -> Limits:
    """Best of several: read bandwidth of a 512 MiB ``torch.sum``, and FLOP/s of a 2048^3 matmul in ``dtype``."""
    x = torch.ones(128 * 2**20)
    a = torch.randn(2048, 2048, dtype=dtype)
    reads, gemms = [], []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        reads.append(time.perf_counter() - start)
        start = time.perf_counter()
        a @ a
        gemms.append(time.perf_counter() - start)
    return {
        "read_gb_s": x.numel() * x.element_size() / min(reads) / 1e9,
        "gemm_gflop_s": 2 * 2048**3 / min(gemms) / 1e9,
        "weight_mb": sum(w.numel() * w.element_size() for w in weights) / 1e6,
        "params": sum(w.numel() for w in weights),
    }


def step_floor_ms(limits: Limits, batch: int) -> float:
    memory = limits["weight_mb"] / 1e3 / limits["read_gb_s"]
    compute = 2 * limits["params"] * batch / (limits["gemm_gflop_s"] * 1e9)
    return max(memory, compute) * 1e3


class Peer:
    """One engine process: a job line in, a Run line out."""

    def __init__(self, kind: str, spec: Spec, log: IO[str]):
        python = str(VLLM_PYTHON) if kind == "vllm" else sys.executable
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"}
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
    running: dict[str, Peer], batches: list[int], prompts: list[list[int]], new_tokens: int, rounds: int
) -> dict[tuple[int, str], dict[str, list[Run]]]:
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


def table(result: dict) -> str:
    lines = [
        "| batch | workload | system | tok/s | vs base | TTFT p50 / p95 ms | TPOT p50 / p95 ms | TPOT / floor |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for kind, s in row["systems"].items():
            lines.append(
                f"| {row['batch']} | {row['workload']} | {kind} | {s['tok_s']:.1f} | {row['ratio_vs_base'][kind]:.2f} | "
                f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p95']:.0f} | "
                f"{s['tpot_ms']['p50']:.1f} / {s['tpot_ms']['p95']:.1f} | {row['tpot_vs_floor'][kind]:.1f}x |"
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
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_peers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: batches 1 and 4, 4 tokens, one round")
    parser.add_argument(
        "--model", choices=("smollm2", "tiny-h64"), default="smollm2", help="base model (tiny-h64: 2-layer, for tests)"
    )
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request (default 32)")
    parser.add_argument("--rounds", type=int, help="repetitions of every job (default 2)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="of both engines")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        parser.error(f"{VLLM_PYTHON} is missing: run `make venv-vllm`")
    batches = args.batches or ([1, 4] if args.quick else [1, 8, 32])
    new_tokens = args.new_tokens or (4 if args.quick else 32)
    rounds = args.rounds or (1 if args.quick else 2)
    model_dir, model_name = base_model_dir(args.model)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)]) for i in range(max(batches))]
    prompts = [chat_ids(tokenizer, t) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    limits = machine_limits(list(model.state_dict().values()), dtype)
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
        }
        progress(f"{len(adapters)} adapters saved; starting the engines")
        logs = Path(tempfile.mkdtemp(prefix="lf-engine-peers-logs-"))  # kept when an engine fails
        with peers(spec, logs) as running:
            progress(", ".join(f"{k} ready in {p.start_s:.0f} s" for k, p in running.items()))
            runs = measure(running, batches, prompts, new_tokens, rounds)
            systems = {k: {"peak_rss_mb": p.peak_rss_mb(), "start_s": p.start_s} for k, p in running.items()}
    shutil.rmtree(logs)
    result = {
        "environment": {**environment(torch.get_num_threads(), args.dtype), "model": model_name},
        "quick": args.quick,
        "dtype": args.dtype,
        "new_tokens": new_tokens,
        "rounds": rounds,
        "batches": batches,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "adapters": {w: max(batches) for w, m in WORKLOADS.items() if m},
        "rank_mix": {str(RANK): len(adapters)},
        "target_modules": {w: list(m) for w, m in WORKLOADS.items() if m},
        "limits": limits,
        "systems": systems,
        "rows": rows_of(runs, limits, new_tokens),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
