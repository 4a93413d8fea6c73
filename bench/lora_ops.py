"""CPU cost of the LoRA reference ops beside the base projection, and of rank skew.

``python -m bench.lora_ops [--quick]``: decode (32 tokens, 32 distinct rank-16 adapters) and prefill
(4 prompts x 128 tokens) on SmolLM2's q_proj / v_proj shapes, each LoRA form timed beside the base
matmul; then rank skew (31 rank-8 + 1 rank-64 by rank class, vs 32 rank-8, vs all padded to 64);
then the per-step metadata build.
Peers are interleaved round by round and reported as medians and ratios.
"""

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import torch

from kernels import LoraIndex, add_lora, index_for
from kernels.bags import add_lora_bags
from kernels.reference import add_lora_gathered, add_lora_segments
from services.worker.lora.metadata import LoraMetadata

HIDDEN = 576
SHAPES = {"q_proj": (HIDDEN, 576), "v_proj": (HIDDEN, 192)}  # SmolLM2-135M: 9 heads x 64, 3 kv heads x 64
NO_WORKSPACE = torch.empty(0)  # the CPU path needs none
RESULTS = Path(__file__).parent / "results" / "lora_ops.json"


def time_peers(peers: dict[str, Callable[[], object]], rounds: int, iters: int) -> dict[str, float]:
    """Median microseconds per call of each peer, the peers interleaved in every round."""
    samples: dict[str, list[float]] = {name: [] for name in peers}
    for fn in peers.values():
        fn()
    for _ in range(rounds):
        for name, fn in peers.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - start) / iters * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


class WorkloadRow(TypedDict):
    workload: str
    module: str
    tokens: int
    us: dict[str, float]
    ratio_vs_base: dict[str, float]


class RankSkew(TypedDict):
    us: dict[str, float]
    skew_vs_uniform: float
    padded_vs_uniform: float


def stack(rows: int, rank: int, in_f: int, out_f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(rows, in_f, rank) * 0.02, torch.randn(rows, rank, out_f) * 0.02, torch.full((rows,), 2.0)


def base_form(x: torch.Tensor, w: torch.Tensor) -> Callable[[], object]:
    return lambda: torch.nn.functional.linear(x, w)


def lora_forms(x: torch.Tensor, y: torch.Tensor, rank: int, rows: torch.Tensor) -> dict[str, Callable[[], object]]:
    a, b, scale = stack(int(rows.max()) + 1, rank, x.shape[1], y.shape[1])
    index = index_for(rows)
    return {
        "gathered": lambda: add_lora_gathered(x, y, a, b, scale, index.token_idx, index.token_row),
        "bags": lambda: add_lora_bags(x, y, a, b, scale, index.bag_plan()),
        "segments": lambda: add_lora_segments(x, y, a, b, scale, index.token_idx, index.segments),
        "dispatch": lambda: add_lora(x, y, a, b, scale, index, NO_WORKSPACE),
    }


def bench_workloads(rounds: int, iters: int) -> list[WorkloadRow]:
    workloads = {"decode": torch.arange(32), "prefill": torch.arange(4).repeat_interleave(128)}
    rows_out: list[WorkloadRow] = []
    for workload, rows in workloads.items():
        for module, (in_f, out_f) in SHAPES.items():
            x, y, w = torch.randn(rows.shape[0], in_f), torch.zeros(rows.shape[0], out_f), torch.randn(out_f, in_f)
            peers = {"base": base_form(x, w), **lora_forms(x, y, 16, rows)}
            us = time_peers(peers, rounds, iters)
            ratios = {k: v / us["base"] for k, v in us.items() if k != "base"}
            rows_out.append(
                {"workload": workload, "module": module, "tokens": rows.shape[0], "us": us, "ratio_vs_base": ratios}
            )
    return rows_out


def bench_rank_skew(rounds: int, iters: int) -> RankSkew:
    """One projection (q_proj), 32 decode tokens, each on its own adapter, computed per rank class."""
    in_f, out_f = SHAPES["q_proj"]
    x, y = torch.randn(32, in_f), torch.zeros(32, out_f)

    def by_class(ranks: list[int]) -> Callable[[], None]:
        classes: list[tuple[tuple[torch.Tensor, ...], LoraIndex]] = []
        for rank in sorted(set(ranks)):
            rows = torch.tensor([i if r == rank else -1 for i, r in enumerate(ranks)])
            classes.append((stack(len(ranks), rank, in_f, out_f), index_for(rows)))

        def run() -> None:
            for (a, b, scale), index in classes:
                add_lora(x, y, a, b, scale, index, NO_WORKSPACE)

        return run

    skewed = [8] * 31 + [64]
    us = time_peers(
        {"uniform_r8": by_class([8] * 32), "skew_by_class": by_class(skewed), "skew_padded_r64": by_class([64] * 32)},
        rounds,
        iters,
    )
    return {
        "us": us,
        "skew_vs_uniform": us["skew_by_class"] / us["uniform_r8"],
        "padded_vs_uniform": us["skew_padded_r64"] / us["uniform_r8"],
    }


def bench_metadata(rounds: int, iters: int) -> dict[str, float]:
    """Per-step cost of sorting the step's token slots into rank-class segments (AdapterManager.prepare)."""
    # 64 / 32 / 16 / 8 slots of rank 8 / 16 / 32 / 64
    meta = LoraMetadata.allocate(max_tokens=2048, class_first_slots=[0, 64, 96, 112, 120], device="cpu")
    decode = torch.randperm(120)[:32]
    prefill = torch.randperm(120)[:4].repeat_interleave(128)
    return time_peers(
        {"decode_32": lambda: meta.fill(decode), "prefill_512": lambda: meta.fill(prefill)},
        rounds,
        iters,
    )


def environment() -> dict[str, object]:
    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        commit = git.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "dtype": "float32",
        "machine": platform.machine(),
        "git_commit": commit,
    }


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def markdown(workloads: list[WorkloadRow], skew: RankSkew, metadata: dict[str, float]) -> str:
    forms = ["base", "gathered", "bags", "segments", "dispatch"]
    rows = [
        [str(w["workload"]), str(w["module"]), str(w["tokens"])]
        + [f"{w['us'][f]:.0f}" for f in forms]
        + [f"{w['ratio_vs_base']['dispatch']:.2f}x"]
        for w in workloads
    ]
    lines = table(["workload", "module", "tokens", *(f"{f} us" for f in forms), "dispatch / base"], rows)
    us = skew["us"]
    skew_rows = [
        ["32 x rank 8", f"{us['uniform_r8']:.0f}", "1.00x"],
        ["31 x rank 8 + 1 x rank 64, by rank class", f"{us['skew_by_class']:.0f}", f"{skew['skew_vs_uniform']:.2f}x"],
        ["same, all padded to rank 64", f"{us['skew_padded_r64']:.0f}", f"{skew['padded_vs_uniform']:.2f}x"],
    ]
    meta_rows = [[name, f"{us:.0f}"] for name, us in metadata.items()]
    return "\n".join(
        [
            *lines,
            "",
            *table(["rank mix (32 decode tokens, q_proj)", "us", "vs 32 x rank 8"], skew_rows),
            "",
            *table(["per-step metadata (prepare), 4 rank classes", "us"], meta_rows),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (well under a minute)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 1 keeps a shared machine's noise low")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, iters = (9, 10) if args.quick else (31, 20)
    torch.manual_seed(0)
    with torch.inference_mode():
        workloads = bench_workloads(rounds, iters)
        skew = bench_rank_skew(rounds, iters)
        metadata = bench_metadata(rounds, iters)
    print(markdown(workloads, skew, metadata))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    report = {"env": environment(), "workloads": workloads, "rank_skew": skew, "metadata_us": metadata}
    RESULTS.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
