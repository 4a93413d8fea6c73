"""Fairness under overload: two tenants offering load 4:1, the scheduler's VTC queue against FIFO.

``python -m bench.fairness [--quick]``: a discrete-event simulation (a live overload run is too
slow on 2 shared cores) driving the scheduler's real ``FairQueue`` with its default weights
(input 1, output 2) in front of a fleet of 8 running slots. Offered load is 1.5x capacity, 80%
from the loud tenant and 20% from the quiet one, Poisson arrivals, 40 prompt + 64 output tokens
per request. The quiet tenant asks for less than half the fleet, so fair service gives it all it
asks (30% of the tokens served) where FIFO gives it its 20% arrival share and an ever longer wait.

``--flood`` adds a live run at intake (``bench/intake_flood.py``): a quiet tenant's request stored
behind one tenant's flood of N, through the scheduler's real consume loop on nats-server and Redis,
its fair intake against arrival order (``fairness_flood.json``).
"""

import argparse
import heapq
import json
import platform
from collections import deque
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np

from bench.cache_sim import git_commit
from services.scheduler.fairness import FairQueue, Priority

RESULTS = Path(__file__).parent / "results"
SLOTS, SERVICE_S, PREFILL_S = 8, 1.0, 0.05
PROMPT, OUTPUT = 40, 64
TENANTS = {"loud": 0.8, "quiet": 0.2}


@dataclass(eq=False)
class Item:
    tenant: str
    enqueued: float
    request_id: str
    priority: Priority = "interactive"


class Fifo:
    def __init__(self) -> None:
        self._q: deque[Item] = deque()

    def push(self, item: Item) -> None:
        self._q.append(item)

    def pop(self, now: float) -> Item | None:
        return self._q.popleft() if self._q else None


class Vtc:
    def __init__(self) -> None:
        self._q: FairQueue[Item] = FairQueue()

    def push(self, item: Item) -> None:
        self._q.push(item)

    def pop(self, now: float) -> Item | None:
        item = self._q.pop(now, lambda _: True)
        if item is not None:
            self._q.charge(item.tenant, PROMPT, OUTPUT)
        return item


def simulate(queue: Fifo | Vtc, arrivals: list[tuple[float, str]], horizon: float) -> dict[str, dict[str, float]]:
    ids = count()
    events = [(t, next(ids), "arrive", tenant) for t, tenant in arrivals]
    heapq.heapify(events)
    free = SLOTS
    tokens = dict.fromkeys(TENANTS, 0)
    ttft: dict[str, list[float]] = {t: [] for t in TENANTS}
    while events:
        now, _, kind, tenant = heapq.heappop(events)
        if now > horizon:
            break
        if kind == "arrive":
            queue.push(Item(tenant, now, f"r{next(ids)}"))
        else:
            free += 1
            tokens[tenant] += PROMPT + OUTPUT
        while free:
            item = queue.pop(now)
            if item is None:
                break
            free -= 1
            ttft[item.tenant].append(now - item.enqueued + PREFILL_S)
            heapq.heappush(events, (now + SERVICE_S, next(ids), "end", item.tenant))
    total = sum(tokens.values())
    return {
        t: {
            "token_share": tokens[t] / total,
            "served_requests": len(ttft[t]),
            "ttft_p50_ms": float(np.percentile(ttft[t], 50) * 1000),
            "ttft_p95_ms": float(np.percentile(ttft[t], 95) * 1000),
        }
        for t in TENANTS
    }


def markdown(result: dict) -> str:
    rows = [
        "| queue | tenant | offered share | served token share | TTFT p50 (ms) | TTFT p95 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for queue in ("vtc", "fifo"):
        for tenant, offered in TENANTS.items():
            r = result[queue][tenant]
            rows.append(
                f"| {queue} | {tenant} | {offered:.2f} | {r['token_share']:.3f} | {r['ttft_p50_ms']:.0f} | "
                f"{r['ttft_p95_ms']:.0f} |"
            )
    rows.append(
        f"\nquiet tenant TTFT p95, VTC / FIFO: {result['quiet_ttft_p95_ratio']:.3f}x "
        f"(simulation, {result['horizon_s']:.0f} s at {result['offered_load']:.1f}x capacity)"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 simulated seconds (about a second)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flood", action="store_true", help="also the live flood at intake (nats-server, redis)")
    args = parser.parse_args()
    horizon, load = (600.0 if args.quick else 3600.0), 1.5
    rng = np.random.default_rng(args.seed)
    rate = load * SLOTS / SERVICE_S
    arrivals = sorted(
        (float(t), tenant)
        for tenant, share in TENANTS.items()
        for t in np.cumsum(rng.exponential(1 / (rate * share), size=int(rate * share * horizon * 1.2)))
    )
    result: dict = {
        "horizon_s": horizon,
        "offered_load": load,
        "slots": SLOTS,
        "mode": "simulation",
        "vtc": simulate(Vtc(), arrivals, horizon),
        "fifo": simulate(Fifo(), arrivals, horizon),
    }
    result["quiet_tenant_share"] = result["vtc"]["quiet"]["token_share"]
    result["fifo_quiet_tenant_share"] = result["fifo"]["quiet"]["token_share"]
    result["quiet_ttft_p95_ratio"] = result["vtc"]["quiet"]["ttft_p95_ms"] / result["fifo"]["quiet"]["ttft_p95_ms"]
    result["environment"] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "git_commit": git_commit(),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fairness.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "fairness.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    if args.flood:
        from bench.intake_flood import flood_markdown, run_flood

        flood = run_flood([0, 100, 300, 1000, 3000], repeats=1 if args.quick else 3)
        flood["environment"] = result["environment"]
        (RESULTS / "fairness_flood.json").write_text(json.dumps(flood, indent=2))
        (RESULTS / "fairness_flood.md").write_text(flood_markdown(flood) + "\n")
        print(flood_markdown(flood))


if __name__ == "__main__":
    main()
