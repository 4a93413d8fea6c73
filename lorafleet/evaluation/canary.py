"""Canary automation: step an adapter's new version through traffic shares, comparing it with the
production version at each step (quality, TTFT, TPOT, error rate), and roll back on regression."""

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai
from nats.aio.client import Client as NATS

from lorafleet.evaluation.release import REGISTRY_TIMEOUT_S, promote
from lorafleet.evaluation.runner import EvalReport, EvalSet, run_eval
from shared import subjects
from shared.adapter_keys import adapter_key
from shared.bus import request
from shared.schemas import (
    AdapterRecordsReply,
    AuditQueryReply,
    AuditQueryRequest,
    GetAdapterRequest,
    RollbackRequest,
    RolloutRequest,
)


@dataclass(frozen=True, slots=True)
class CanaryPolicy:
    max_quality_drop: float = 0.05  # absolute eval-score points
    max_latency_ratio: float = 2.0  # median TTFT / TPOT of new over old
    max_error_rate_increase: float = 0.05


@dataclass(frozen=True, slots=True)
class VersionStats:
    score: float
    error_rate: float
    ttft_ms: float | None  # median over the eval's requests, from the audit trail; None if not found
    tpot_ms: float | None


@dataclass(frozen=True, slots=True)
class CanaryOutcome:
    released: bool
    percent: float  # the last traffic share reached
    reasons: list[str]


def regressions(new: VersionStats, old: VersionStats, policy: CanaryPolicy) -> list[str]:
    """Why ``new`` is worse than ``old`` beyond the policy's tolerances; empty when it is not."""
    reasons = []
    if new.score < old.score - policy.max_quality_drop:
        reasons.append(f"quality {new.score:.3f} vs {old.score:.3f} (allowed drop {policy.max_quality_drop:.3f})")
    if new.error_rate > old.error_rate + policy.max_error_rate_increase:
        reasons.append(f"error rate {new.error_rate:.3f} vs {old.error_rate:.3f}")
    for name, mine, theirs in (("TTFT", new.ttft_ms, old.ttft_ms), ("TPOT", new.tpot_ms, old.tpot_ms)):
        if mine is not None and theirs and mine > theirs * policy.max_latency_ratio:
            reasons.append(f"{name} {mine:.1f} ms vs {theirs:.1f} ms (allowed x{policy.max_latency_ratio:g})")
    return reasons


async def latency(
    nc: NATS, adapter_id: str, report: EvalReport, since: float, wait_s: float = 5.0
) -> tuple[float | None, float | None]:
    """Median (TTFT, TPOT) of the report's requests, from the auditor (its records arrive shortly after)."""
    ids = {r for r in report.request_ids if r}
    query = AuditQueryRequest(adapter_id=adapter_id, kind="completion", since=since, limit=1000)
    deadline = time.monotonic() + wait_s
    while True:
        records = (await request(nc, subjects.AUDITOR_QUERY, query, AuditQueryReply, REGISTRY_TIMEOUT_S)).records
        rows = [r for r in records if r.get("request_id") in ids]
        if len(rows) >= len(ids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    if not rows:
        return None, None
    return statistics.median(r["ttft_ms"] for r in rows), statistics.median(r["tpot_ms"] for r in rows)


async def measure(
    nc: NATS, client: openai.AsyncOpenAI, adapter_id: str, version: int, eval_set: EvalSet, max_tokens: int
) -> VersionStats:
    since = time.time()
    report = await run_eval(client, adapter_key(adapter_id, version), eval_set, max_tokens=max_tokens)
    ttft, tpot = await latency(nc, adapter_id, report, since)
    return VersionStats(score=report.score, error_rate=report.error_rate, ttft_ms=ttft, tpot_ms=tpot)


async def run_canary(
    nc: NATS,
    client: openai.AsyncOpenAI,
    adapter_id: str,
    version: int,
    steps: list[float],
    eval_set: EvalSet,
    *,
    actor: str,
    policy: CanaryPolicy = CanaryPolicy(),
    max_tokens: int = 48,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> CanaryOutcome:
    """Promote ``version`` to the first step's share, then check and advance; roll back on regression."""
    records = (
        await request(
            nc,
            subjects.registry("get"),
            GetAdapterRequest(adapter_id=adapter_id),
            AdapterRecordsReply,
            REGISTRY_TIMEOUT_S,
        )
    ).records
    old = next((r.version for r in records if r.status == "production" and r.version != version), None)
    current = next((r for r in records if r.version == version), None)
    if current is None or current.status == "staging":
        await promote(
            nc, adapter_id, version, steps[0], actor, force=force, reason="forced canary start" if force else None
        )
        say(f"{adapter_id} v{version}: canary at {steps[0]:g}%")
    for i, percent in enumerate(steps):
        if i > 0:
            await request(
                nc,
                subjects.registry("rollout"),
                RolloutRequest(adapter_id=adapter_id, traffic_percent=percent, actor=actor),
                AdapterRecordsReply,
                REGISTRY_TIMEOUT_S,
            )
            say(f"{adapter_id} v{version}: rollout to {percent:g}%")
        if old is None or percent >= 100:
            continue  # nothing to compare with, or the new version already took all traffic
        new_stats = await measure(nc, client, adapter_id, version, eval_set, max_tokens)
        old_stats = await measure(nc, client, adapter_id, old, eval_set, max_tokens)
        say(f"  step {percent:g}%: v{version} {_show(new_stats)} | v{old} {_show(old_stats)}")
        reasons = regressions(new_stats, old_stats, policy)
        if reasons:
            why = f"canary v{version} at {percent:g}% regressed vs v{old}: " + "; ".join(reasons)
            await request(
                nc,
                subjects.registry("rollback"),
                RollbackRequest(adapter_id=adapter_id, reason=why[:500], actor=actor),
                AdapterRecordsReply,
                REGISTRY_TIMEOUT_S,
            )
            say(f"rolled back: {why}")
            return CanaryOutcome(released=False, percent=percent, reasons=reasons)
    return CanaryOutcome(released=True, percent=steps[-1], reasons=[])


def _show(stats: VersionStats) -> str:
    ttft = f"{stats.ttft_ms:.0f}" if stats.ttft_ms is not None else "?"
    tpot = f"{stats.tpot_ms:.0f}" if stats.tpot_ms is not None else "?"
    return f"quality {stats.score:.3f} errors {stats.error_rate:.2f} TTFT {ttft} ms TPOT {tpot} ms"
