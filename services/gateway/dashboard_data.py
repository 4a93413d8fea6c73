"""What the dashboard shows, summarised from heartbeats, registry records and recent audit records."""

import math
from collections import defaultdict

from shared.adapter_keys import adapter_key
from shared.schemas import AdapterRecord, ExperimentStatusReply, Interval, WorkerHeartbeat


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def traffic(completions: list[dict]) -> dict:
    """Hit rate, TTFT p95 hit vs miss, per-tenant and per-adapter traffic, a TTFT time series."""
    ttft: dict[bool, list[float]] = {True: [], False: []}
    tenants: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "tokens": 0})
    adapters: dict[str, int] = defaultdict(int)
    completions = [c for c in completions if c.get("shadow_of") is None]  # shadow runs served no tenant
    for c in completions:
        if c.get("cache_hit") is not None:
            ttft[bool(c["cache_hit"])].append(c["ttft_ms"])
        tenants[c["tenant_id"]]["requests"] += 1
        tenants[c["tenant_id"]]["tokens"] += c["completion_tokens"]
        name = adapter_key(c["adapter_id"], c["adapter_version"]) if c.get("adapter_id") else "base"
        adapters[name] += c["completion_tokens"]
    lookups = len(ttft[True]) + len(ttft[False])
    return {
        "requests": len(completions),
        "hit_rate": len(ttft[True]) / lookups if lookups else None,
        "ttft_p95_hit_ms": p95(ttft[True]),
        "ttft_p95_miss_ms": p95(ttft[False]),
        "tenants": dict(tenants),
        "adapter_tokens": dict(sorted(adapters.items(), key=lambda kv: -kv[1])[:12]),
        "ttft_series": [[c["ts"], c["ttft_ms"], c.get("cache_hit")] for c in completions[-200:]],
    }


def told_hit(record: dict, own: set[str]) -> dict:
    """A tenant admin's view of a record's cache_hit: none for an adapter the tenant does not own (as the
    worker tells the requester), whose residency other tenants' traffic keeps up."""
    adapter_id = record.get("adapter_id")
    if "cache_hit" in record and adapter_id is not None and adapter_id not in own:
        return {"cache_hit": None}
    return {}


def workers(beats: list[WorkerHeartbeat]) -> list[dict]:
    return [
        {
            "worker_id": b.worker_id,
            "running": b.running,
            "waiting": b.waiting,
            "max_running": b.max_running,
            "kv_used": 1 - b.kv_blocks_free / max(1, b.kv_blocks_total),
            "slots": b.slots,
            "gpu_adapters": b.resident_adapters,
            "cpu_adapters": b.cpu_adapters,
            "hit_ratio": b.cache_hit_ratio,
            "load_ms_mean": b.load_ms_mean,
        }
        for b in sorted(beats, key=lambda b: b.worker_id)
    ]


def adapters(records: list[AdapterRecord]) -> list[dict]:
    return [
        {
            "adapter_id": r.adapter_id,
            "version": r.version,
            "tenant_id": r.tenant_id,
            "status": r.status,
            "traffic_percent": r.traffic_percent,
            "rank": r.rank,
            "eval": _eval(r),
        }
        for r in sorted(records, key=lambda r: (r.adapter_id, r.version))
    ]


def _eval(record: AdapterRecord) -> dict[str, float]:
    """The platform-run score the gate read, and a client's own score beside it, marked advisory."""
    shown = {}
    if record.platform_eval is not None:
        shown = {"platform": record.platform_eval.score, "threshold": record.platform_eval.threshold}
    if "score" in record.eval_results:
        shown["client_advisory"] = record.eval_results["score"]
    return shown


def experiments(statuses: list[ExperimentStatusReply]) -> list[dict]:
    """One row per arm: its experiment's state, its traffic and figures, each as value [low, high]."""
    return [
        {
            "tenant_id": s.experiment.tenant_id,
            "experiment": s.experiment.name,
            "state": s.experiment.state,
            "winner": s.experiment.winner,
            "arm": a.arm,
            "target": a.target,
            "count": a.count,
            "share": _ci(a.share),
            "ttft_p50_ms": _ci(a.ttft_p50_ms),
            "tpot_p50_ms": _ci(a.tpot_p50_ms),
            "engine_ms_per_token": _ci(a.engine_ms_per_token),
            "complaint_rate": _ci(a.complaint_rate),
            "eval_score": _ci(a.eval_score),
        }
        for s in statuses
        for a in s.arms
    ]


def _ci(interval: Interval) -> list[float | None]:
    return [interval.value, interval.low, interval.high]
