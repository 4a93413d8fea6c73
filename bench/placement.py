"""Placement over a fleet: the scheduler's affinity placement against round-robin, same trace.

``python -m bench.placement [--quick]``: a discrete-event simulation (a live run of three workers
is too slow on 2 shared cores) driving the scheduler's real ``Fleet.choose`` on heartbeats built
from each simulated worker, and each worker's real GPU ``SlotTier`` with the heat eviction policy
fed by the scheduler's ``DecayedRate``. Three workers of 8 running requests and 16 rank-16 slots
each; zipf(1.1) traffic over 300 adapters as a Poisson stream at ~70% of fleet capacity. A
request's TTFT is its wait for a running slot, plus an adapter load on a GPU miss, plus prefill.
"""

import argparse
import heapq
import json
import platform
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.cache_sim import git_commit
from services.scheduler.placement import Fleet
from services.worker.adapter_cache.cache_config import CacheConfig, PolicyName
from services.worker.adapter_cache.policy import Entry, make_policy
from services.worker.adapter_cache.slot_tier import SlotTier
from shared.decay import DecayedRate
from shared.schemas import InferRequest, ResolvedAdapter, WorkerHeartbeat

RESULTS = Path(__file__).parent / "results"
POLICIES: tuple[PolicyName, ...] = ("heat", "lru")  # heat: the workers' default; lru: without fleet heat
RANK, SLOTS, MAX_RUNNING, WORKERS, ADAPTERS = 16, 16, 8, 3, 300
LOAD_S, PREFILL_S, DECODE_S = 0.25, 0.03, 0.4  # adapter load on a miss; per-request compute


@dataclass
class SimWorker:
    worker_id: str
    slots: SlotTier
    running: int = 0
    hits: int = 0
    misses: int = 0

    def beat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            base_model="base",
            ready=True,
            running=self.running,
            waiting=0,
            max_running=MAX_RUNNING,
            kv_blocks_free=100,
            kv_blocks_total=100,
            resident_adapters=self.slots.keys(),
        )

    def start(self, key: str, now: float) -> float:
        """Run one request of adapter ``key``: its time to first token."""
        self.running += 1
        self.slots.policy.touch(key, now)
        if key in self.slots:
            self.hits += 1
            return PREFILL_S
        self.misses += 1
        entry = Entry(key, RANK)
        if self.slots.free(RANK) == 0:
            victim = self.slots.victim(entry, now, protected=lambda _: False)
            assert victim is not None, "a full tier with nothing protected always has a victim"
            self.slots.remove(victim.key)
        self.slots.reserve(RANK)
        self.slots.commit(entry)
        return LOAD_S + PREFILL_S


def key_of(request: InferRequest) -> str:
    """The cache key of the request's adapter (every simulated request names one)."""
    assert request.adapter is not None
    return f"{request.adapter.adapter_id}@1"


def request_for(adapter: int) -> InferRequest:
    resolved = ResolvedAdapter(
        adapter_id=f"adapter-{adapter:03d}", version=1, rank=RANK, digest="0" * 64, storage_uri="x", alpha=16
    )
    return InferRequest(
        request_id="r", tenant_id="t", model="m", base_model="base", prompt="p", reply_to="_INBOX.x", adapter=resolved
    )


@dataclass
class Simulation:
    workers: list[SimWorker]
    placement: Callable[["Simulation", InferRequest, float], SimWorker | None]
    fleet: Fleet = field(default_factory=lambda: Fleet(timeout_s=1e9, headroom=0))
    rr_next: int = 0

    def refresh(self, now: float) -> None:
        for w in self.workers:
            self.fleet.heartbeat(w.beat(), now)


def affinity(sim: Simulation, request: InferRequest, now: float) -> SimWorker | None:
    sim.refresh(now)
    chosen = sim.fleet.choose(request, now=now)
    return next((w for w in sim.workers if w.worker_id == chosen), None)


def round_robin(sim: Simulation, request: InferRequest, now: float) -> SimWorker | None:
    for i in range(len(sim.workers)):
        w = sim.workers[(sim.rr_next + i) % len(sim.workers)]
        if w.running < MAX_RUNNING:
            sim.rr_next = (sim.rr_next + i + 1) % len(sim.workers)
            return w
    return None


def simulate(trace: np.ndarray, arrivals: np.ndarray, placement: Callable, policy: PolicyName) -> dict[str, float]:
    config = CacheConfig()
    workers = [SimWorker(f"w{i}", SlotTier({RANK: SLOTS}, make_policy(policy, config))) for i in range(WORKERS)]
    sim = Simulation(workers, placement)
    heat, next_heat = DecayedRate(config.half_life_s), 0.0
    requests = [request_for(int(a)) for a in trace]
    events: list[tuple[float, int, int, str]] = [(float(t), i, 0, "arrive") for i, t in enumerate(arrivals)]
    heapq.heapify(events)
    queue: deque[tuple[int, float]] = deque()
    ttft: list[float] = []
    holder: dict[int, SimWorker] = {}

    def start_waiting(now: float) -> None:
        while queue:
            index, arrived = queue[0]
            worker = sim.placement(sim, requests[index], now)
            if worker is None:
                return
            queue.popleft()
            first = worker.start(key_of(requests[index]), now)
            ttft.append(now - arrived + first)
            holder[index] = worker
            heapq.heappush(events, (now + first + DECODE_S, index, 1, "end"))

    while events:
        now, index, _, kind = heapq.heappop(events)
        if now >= next_heat:
            for w in workers:
                w.slots.policy.update_heat(heat.snapshot(now))
            next_heat = now + 5.0
        if kind == "arrive":
            heat.bump(key_of(requests[index]), now)
            queue.append((index, now))
        else:
            holder.pop(index).running -= 1
        start_waiting(now)
    hits, total = sum(w.hits for w in workers), sum(w.hits + w.misses for w in workers)
    return {
        "hit_rate": hits / total,
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1000),
        "ttft_p95_ms": float(np.percentile(ttft, 95) * 1000),
    }


def markdown(result: dict) -> str:
    rows = [
        "| worker eviction policy | placement | GPU hit rate | TTFT p50 (ms) | TTFT p95 (ms) |",
        "|---|---|---|---|---|",
    ]
    for policy in POLICIES:
        for name in ("affinity", "round_robin"):
            r = result["policies"][policy][name]
            rows.append(
                f"| {policy} | {name} | {r['hit_rate']:.3f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} |"
            )
    rows.append(
        f"\nheat policy, affinity / round-robin TTFT p95: {result['ttft_p95_ratio']:.2f}x "
        f"(simulation, {result['requests']} requests at {result['rate_rps']:.0f} req/s)"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6,000 requests (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = 6_000 if args.quick else 40_000
    rng = np.random.default_rng(args.seed)
    weights = 1.0 / np.arange(1, ADAPTERS + 1) ** 1.1
    trace = rng.choice(ADAPTERS, size=n, p=weights / weights.sum())
    capacity = WORKERS * MAX_RUNNING / (PREFILL_S + DECODE_S + LOAD_S * 0.3)
    rate = 0.7 * capacity
    arrivals = np.cumsum(rng.exponential(1 / rate, size=n))
    result: dict = {
        "requests": n,
        "rate_rps": rate,
        "workers": WORKERS,
        "adapters": ADAPTERS,
        "slots": SLOTS,
        "mode": "simulation",
        "policies": {
            policy: {
                "affinity": simulate(trace, arrivals, affinity, policy),
                "round_robin": simulate(trace, arrivals, round_robin, policy),
            }
            for policy in POLICIES
        },
    }
    default = result["policies"]["heat"]
    result["affinity_hit_rate"] = default["affinity"]["hit_rate"]
    result["round_robin_hit_rate"] = default["round_robin"]["hit_rate"]
    result["ttft_p95_ratio"] = default["affinity"]["ttft_p95_ms"] / default["round_robin"]["ttft_p95_ms"]
    result["environment"] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "git_commit": git_commit(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "placement.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "placement.md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
