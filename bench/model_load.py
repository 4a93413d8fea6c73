"""Base-model load time and memory: the worker's loader against transformers ``from_pretrained``.

``python -m bench.model_load [--model-dir DIR] [--rounds N]``: for fp32 and bf16, each system
loads the model in a fresh process (the page cache is warm after the first read, for both alike):

- ``lorafleet``: ``load_model(dtype=...)`` then ``load_weights`` — what a worker holds before it
  serves: the engine's fused q/k/v and gate/up weights, the transformers modules rebound onto them.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=...)``, nothing else.

Reported per run: wall time of the load, RSS of the runtime before it (interpreter, torch,
transformers imported), RSS after it, peak RSS, and the weight bytes in the serving dtype
(every distinct tensor storage of the model counted once). The target is
``rss_after - runtime <= 1.2 x weight bytes``.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TypedDict

from bench.soak.procstat import rss_mb

RESULTS = Path(__file__).parent / "results" / "model_load.json"
DTYPES = ("float32", "bfloat16")
SYSTEMS = ("lorafleet", "transformers")


class Probe(TypedDict):
    load_s: float
    runtime_rss_mib: float
    rss_after_mib: float
    peak_rss_mib: float
    weight_mib: float


def rss_mib() -> float:
    return rss_mb(os.getpid())  # /proc's VmRSS in kB / 1024, i.e. MiB


def probe(system: str, dtype_name: str, model_dir: str | None) -> Probe:
    """One load in this (fresh) process."""
    import torch
    import transformers

    from services.worker.engine.model_loader import load_model
    from services.worker.engine.weights import load_weights
    from shared.base_model import resolve_model_dir

    dtype = getattr(torch, dtype_name)
    directory = resolve_model_dir(model_dir)
    transformers.AutoTokenizer.from_pretrained(directory)  # both systems hold a tokenizer; not timed
    runtime = rss_mib()
    start = time.perf_counter()
    if system == "lorafleet":
        loaded = load_model(model_dir, dtype=dtype)
        model = loaded.model
        weights = load_weights(model, dtype, "cpu", 2048)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        weights = None
    load_s = time.perf_counter() - start
    storages: dict[int, int] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    del weights
    return Probe(
        load_s=load_s,
        runtime_rss_mib=runtime,
        rss_after_mib=rss_mib(),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        weight_mib=sum(storages.values()) / 2**20,
    )


def run_probe(system: str, dtype: str, model_dir: str | None) -> Probe:
    command = [sys.executable, "-m", "bench.model_load", "--probe", system, dtype]
    if model_dir:
        command += ["--model-dir", model_dir]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    result: Probe = json.loads(out.strip().splitlines()[-1])
    return result


def summarise(runs: list[Probe]) -> dict[str, float]:
    best = min(runs, key=lambda r: r["load_s"])
    return {
        "load_s_best": round(best["load_s"], 3),
        "load_s_median": round(statistics.median(r["load_s"] for r in runs), 3),
        "runtime_rss_mib": round(statistics.median(r["runtime_rss_mib"] for r in runs), 1),
        "rss_after_mib": round(statistics.median(r["rss_after_mib"] for r in runs), 1),
        "peak_rss_mib": round(max(r["peak_rss_mib"] for r in runs), 1),
        "weight_mib": round(best["weight_mib"], 1),
        "held_over_weights": round(
            statistics.median((r["rss_after_mib"] - r["runtime_rss_mib"]) / r["weight_mib"] for r in runs), 3
        ),
        "peak_over_weights": round(max((r["peak_rss_mib"] - r["runtime_rss_mib"]) / r["weight_mib"] for r in runs), 3),
    }


def table(rows: dict[str, dict[str, dict[str, float]]]) -> str:
    head = f"{'dtype':9} {'system':13} {'load s':>7} {'runtime':>8} {'after':>8} {'peak':>8} {'weights':>8} {'held/w':>7} {'peak/w':>7}"
    lines = [head, "-" * len(head)]
    for dtype, systems in rows.items():
        for system, s in systems.items():
            lines.append(
                f"{dtype:9} {system:13} {s['load_s_best']:7.2f} {s['runtime_rss_mib']:8.0f} {s['rss_after_mib']:8.0f}"
                f" {s['peak_rss_mib']:8.0f} {s['weight_mib']:8.0f} {s['held_over_weights']:7.2f} {s['peak_over_weights']:7.2f}"
            )
    lines.append(
        "(MiB; held/w = (after - runtime) / weights, peak/w = (peak - runtime) / weights; target held/w <= 1.2)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="a model directory (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=3, help="fresh-process loads per system and dtype")
    parser.add_argument("--probe", nargs=2, metavar=("SYSTEM", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe[0], args.probe[1], args.model_dir)))
        return
    run_probe("transformers", "float32", args.model_dir)  # warm the page cache for everyone
    runs: dict[str, dict[str, list[Probe]]] = {d: {s: [] for s in SYSTEMS} for d in DTYPES}
    for _ in range(args.rounds):  # interleaved, so drift hits both systems alike
        for dtype in DTYPES:
            for system in SYSTEMS:
                runs[dtype][system].append(run_probe(system, dtype, args.model_dir))
    rows = {d: {s: summarise(runs[d][s]) for s in SYSTEMS} for d in DTYPES}
    result = {"model_dir": args.model_dir, "rounds": args.rounds, "results": rows, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(table(rows))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
