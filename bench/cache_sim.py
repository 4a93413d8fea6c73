"""Adapter cache policies on a shifting zipf trace: GPU / CPU tier hit rates of LRU, LFU, heat, Belady.

``python -m bench.cache_sim [--quick]``: 1,000 adapters, zipf(1.1) popularity whose ranking rotates
(every ``shift_every`` requests the ``shift`` hottest ranks go to adapters from the cold tail, as new
adapters rise), 100,000 requests at a steady 100 requests/s, 64 GPU slots over 256 CPU entries.
Each GPU policy runs through the worker's own SlotTier / CpuTier / policy classes with the default
CacheConfig (the CPU tier keeps its configured policy in every row); the heat policy gets fleet heat
from the same DecayedRate the scheduler would publish, refreshed every 5 simulated seconds (a
heartbeat). Belady's MIN (evict the resident used farthest in the future) is the offline bound.
The slot sweep (the PNG) runs the GPU tier alone.
"""

import argparse
import heapq
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

from services.worker.adapter_cache.cache_config import CacheConfig, PolicyName
from services.worker.adapter_cache.cpu_tier import CpuTier
from services.worker.adapter_cache.policy import Entry, make_policy
from services.worker.adapter_cache.slot_tier import SlotTier
from services.worker.lora.layout import AdapterWeights
from shared.decay import DecayedRate

RESULTS = Path(__file__).parent / "results"
POLICIES: tuple[PolicyName, ...] = ("lru", "lfu", "heat")
RANK = 16
WEIGHTS = AdapterWeights(rank=RANK, scale=1.0, a={(0, "q_proj"): torch.zeros(1)}, b={(0, "q_proj"): torch.zeros(1)})


def zipf_trace(adapters: int, requests: int, alpha: float, shift_every: int, shift: int, seed: int) -> np.ndarray:
    """Adapter index per request; the rank -> adapter map rotates by ``shift`` every ``shift_every`` requests."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, adapters + 1) ** alpha
    ranks = rng.choice(adapters, size=requests, p=weights / weights.sum())
    owner = rng.permutation(adapters)
    trace = np.empty(requests, dtype=np.int64)
    for start in range(0, requests, shift_every):
        stop = min(start + shift_every, requests)
        trace[start:stop] = owner[ranks[start:stop]]
        owner = np.roll(owner, shift)
    return trace


def simulate(trace: np.ndarray, policy: PolicyName, gpu_slots: int, cpu_entries: int, config: CacheConfig,
             rate: float = 100.0, publish_s: float = 5.0) -> dict[str, float]:  # fmt: skip
    """Hit rates of the GPU tier, of the CPU tier (share of GPU misses it answers) and of both together."""
    gpu_policy, cpu_policy = make_policy(policy, config), make_policy(config.cpu_policy, config, config.cpu_half_life_s)
    slots = SlotTier({RANK: gpu_slots}, gpu_policy)
    cpu = CpuTier(cpu_entries * WEIGHTS.nbytes, cpu_policy)
    scheduler_heat = DecayedRate(config.half_life_s)
    gpu_hits = cpu_hits = 0
    next_publish = 0.0
    for i, adapter in enumerate(trace.tolist()):
        now, key = i / rate, f"adapter-{adapter:04d}@1"
        if now >= next_publish:
            heat = scheduler_heat.snapshot(now)
            gpu_policy.update_heat(heat)
            cpu_policy.update_heat(heat)
            next_publish += publish_s
        scheduler_heat.bump(key, now)
        gpu_policy.touch(key, now)
        cpu_policy.touch(key, now)
        if key in slots:
            gpu_hits += 1
            continue
        entry = Entry(key, RANK)
        if key in cpu:
            cpu_hits += 1
        else:
            cpu.put(entry, WEIGHTS, now)
        if slots.free(RANK) == 0:
            victim = slots.victim(entry, now, protected=lambda _: False)
            assert victim is not None
            slots.remove(victim.key)
        slots.reserve(RANK)
        slots.commit(entry)
    n = len(trace)
    return {"gpu": gpu_hits / n, "cpu": cpu_hits / max(1, n - gpu_hits), "any": (gpu_hits + cpu_hits) / n}


def belady(trace: np.ndarray, slots: int) -> float:
    """Hit rate of MIN: on a miss with a full cache, evict the resident whose next use is farthest."""
    n = len(trace)
    next_use = np.empty(n, dtype=np.int64)
    seen: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = seen.get(int(trace[i]), n + i)  # never again: farther than any real use, distinct
        seen[int(trace[i])] = i
    resident: dict[int, int] = {}  # adapter -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, adapter), stale entries skipped
    hits = 0
    for i, adapter in enumerate(trace.tolist()):
        if adapter in resident:
            hits += 1
        elif len(resident) >= slots:
            while True:
                far, victim = heapq.heappop(heap)
                if resident.get(victim) == -far:
                    del resident[victim]
                    break
        resident[adapter] = int(next_use[i])
        heapq.heappush(heap, (-int(next_use[i]), adapter))
    return hits / n


def git_commit() -> str:
    head = Path(__file__).resolve().parent.parent / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        return (head.parent / ref[5:]).read_text().strip() if ref.startswith("ref: ") else ref
    except OSError:
        return "unknown"


def markdown(result: dict) -> str:
    rows = [
        "| policy | GPU hit rate | vs Belady | CPU tier hit rate (of GPU misses) | GPU or CPU |",
        "|---|---|---|---|---|",
    ]
    for name in POLICIES:
        tiers = result["tiers"][name]
        rows.append(f"| {name} | {result[name]:.4f} | {result[name] / result['belady']:.3f}x | "
                    f"{tiers['cpu']:.4f} | {tiers['any']:.4f} |")  # fmt: skip
    rows.append(f"| belady | {result['belady']:.4f} | 1.000x | - | - |")
    rows.append("")
    rows.append("| GPU slots | " + " | ".join((*POLICIES, "belady")) + " |")
    rows.append("|---" * (len(POLICIES) + 2) + "|")
    for i, slots in enumerate(result["sweep"]["slots"]):
        rows.append(f"| {slots} | " + " | ".join(f"{result['sweep'][p][i]:.4f}" for p in (*POLICIES, "belady")) + " |")
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in (*POLICIES, "belady"):
        ax.plot(result["sweep"]["slots"], result["sweep"][name], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPU slots")
    ax.set_ylabel("GPU-tier hit rate")
    ax.set_title(f"{result['workload']['adapters']} adapters, zipf({result['workload']['alpha']}), shifting")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 requests, 3 sweep points (under a minute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = 20_000 if args.quick else 100_000
    workload = {"adapters": 1000, "requests": requests, "alpha": 1.1, "shift_every": 10_000, "shift": 50,
                "gpu_slots": 64, "cpu_entries": 256, "seed": args.seed}  # fmt: skip
    trace = zipf_trace(1000, requests, 1.1, 10_000, 50, args.seed)
    config = CacheConfig()
    started = time.perf_counter()
    result: dict = {"workload": workload, "config": config.model_dump(mode="json"), "tiers": {}}
    for name in POLICIES:
        result["tiers"][name] = simulate(trace, name, 64, 256, config)
        result[name] = result["tiers"][name]["gpu"]
    result["belady"] = belady(trace, 64)
    result["heat_vs_lru"] = result["heat"] / result["lru"]
    result["heat_vs_belady"] = result["heat"] / result["belady"]
    sweep_slots = [16, 64, 256] if args.quick else [16, 32, 64, 128, 256]
    result["sweep"] = {"slots": sweep_slots, "belady": [belady(trace, s) for s in sweep_slots]}
    for name in POLICIES:
        result["sweep"][name] = [simulate(trace, name, s, 0, config)["gpu"] for s in sweep_slots]
    result["seconds"] = time.perf_counter() - started
    result["environment"] = {"python": platform.python_version(), "machine": platform.machine(),
                             "torch": torch.__version__, "git_commit": git_commit()}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cache_sim.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "cache_sim.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
