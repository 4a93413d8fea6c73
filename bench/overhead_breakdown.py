"""Where a request's time goes before its worker starts: per-hop figures from the services' spans.

Every service writes its OpenTelemetry spans to one JSON-lines file (``LF_TRACE_EXPORTER=file:``);
spans of one request share a trace id (the context rides in NATS headers). On one machine the
services share a clock, so the gaps between spans are the hops: the gateway's checks and its
resolve (from its catalog mirror), JetStream publish up to the scheduler's fetch, admission, the
wait for a placement, the dispatch round trip to the worker, and the accept notice back to the gateway.
"""

import json
import statistics
from collections import defaultdict
from pathlib import Path

HTTP = "POST /v1/chat/completions"
PUBLISH = "gateway.publish"
HOPS = (
    ("HTTP in -> handler", HTTP, "start", "gateway.request", "start"),
    ("handler -> publish (checks, resolve)", "gateway.request", "start", PUBLISH, "start"),
    ("publish -> scheduler fetch", PUBLISH, "start", "scheduler.admit", "start"),
    ("scheduler admission", "scheduler.admit", "start", "scheduler.admit", "end"),
    ("queue -> placement", "scheduler.admit", "end", "scheduler.place", "start"),
    ("dispatch -> worker accept", "scheduler.place", "start", "worker.accept", "end"),
    ("accept -> gateway", "worker.accept", "end", "gateway.request", "end"),
    ("HTTP in -> accepted", HTTP, "start", "gateway.request", "end"),
)


def _ns(stamp: str) -> int:
    """Nanoseconds of the day from an exporter timestamp like 2026-11-29T17:04:39.123456Z."""
    clock = stamp.rstrip("Z").split("T")[1]
    hours, minutes, seconds = clock.split(":")
    whole, _, frac = seconds.partition(".")
    return ((int(hours) * 60 + int(minutes)) * 60 + int(whole)) * 10**9 + int((frac + "000000000")[:9])


def traces(path: Path) -> dict[str, dict[str, dict[str, int]]]:
    """trace id -> span name -> {"start", "end"} in ns (the first span of that name in the trace)."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(dict)
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        span = json.loads(line)
        trace_id = span["context"]["trace_id"]
        out[trace_id].setdefault(span["name"], {"start": _ns(span["start_time"]), "end": _ns(span["end_time"])})
    return out


def breakdown(path: Path) -> dict[str, dict[str, float]]:
    """Per hop: p50 / p95 / mean in ms over the traces that have both ends of it."""
    samples: dict[str, list[float]] = defaultdict(list)
    for spans in traces(path).values():
        if "gateway.request" not in spans or "worker.accept" not in spans:
            continue
        for label, a, a_edge, b, b_edge in HOPS:
            if a in spans and b in spans:
                samples[label].append((spans[b][b_edge] - spans[a][a_edge]) / 1e6)
    result = {}
    for label, *_ in HOPS:
        values = sorted(samples.get(label, []))
        if values:
            result[label] = {
                "p50": statistics.median(values),
                "p95": values[round(0.95 * (len(values) - 1))],
                "mean": statistics.fmean(values),
                "n": len(values),
            }
    return result


def table(result: dict[str, dict[str, float]]) -> str:
    rows = ["| hop | p50 (ms) | p95 (ms) | mean (ms) |", "|---|---:|---:|---:|"]
    rows += [f"| {label} | {v['p50']:.2f} | {v['p95']:.2f} | {v['mean']:.2f} |" for label, v in result.items()]
    return "\n".join(rows)
