"""What the platform adds to time-to-first-token: the full stack (HTTP gateway + NATS + scheduler +
worker) against the same request handed to the worker's engine in-process (``AsyncEngine``).

``python -m bench.gateway_overhead [--quick]``: SmolLM2 on this machine's worker device. Phase 1
starts nats-server, redis-server and the five services, makes a tenant and key through the
registry, and times streamed chat requests from sending the HTTP request to the first content
chunk. Phase 2 (stack stopped, so the two never share CPU) loads the same model into an
``AsyncEngine`` and times the same prompts from submit to the first token. Requests run one at
a time, so TTFT is prefill plus whatever each hop adds.

Prefill time swings with CPU contention far more than the few milliseconds the hops cost, so the
headline figure is paired: for each stack request, its client-side TTFT minus the TTFT its worker
measured for it (from taking the request to its first token: the engine's own share, read from
the request's completion audit record). The unpaired engine-vs-stack figures are reported beside
it. Writes bench/results/gateway_overhead.json and a Markdown table.
"""

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from bench import overhead_breakdown
from bench.cache_sim import git_commit
from bench.load.stack import UNLIMITED_QUOTAS
from bench.raw_http import RawStreamClient
from lorafleet.cli.adapter_cmd import cli_connect
from lorafleet.cli.infra import free_port, start_nats, start_redis
from lorafleet.cli.stack import SERVICES, Stack, wait_ready
from shared import subjects
from shared.bus import decode, request
from shared.schemas import (
    ApiKeyCreatedReply,
    AuditEnvelope,
    CompletionAudit,
    CreateApiKeyRequest,
    CreateTenantRequest,
    SamplingParams,
    TenantsReply,
)

RESULTS = Path(__file__).parent / "results" / "gateway_overhead.json"
SPANS = RESULTS.with_suffix(".spans.jsonl")
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    f"In one sentence, what is {t}?"
    for t in ("the sea", "a red fox", "a prime number", "the moon", "coffee", "rain", "a lighthouse", "bread")
]


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
        "n": len(ordered),
    }


async def _tenant_key(nats_url: str) -> str:
    nc = await cli_connect(nats_url)
    try:
        await request(
            nc,
            subjects.registry("tenant_create"),
            CreateTenantRequest(tenant_id="bench", actor="bench"),
            TenantsReply,
            10,
        )
        created = await request(
            nc,
            subjects.registry("api_key_create"),
            CreateApiKeyRequest(tenant_id="bench", actor="bench"),
            ApiKeyCreatedReply,
            10,
        )
        return created.key
    finally:
        await nc.drain()


def _first_content(data: str) -> bool:
    """Whether an SSE chunk carries generated text (not the role-only opening chunk)."""
    return "data: {" in data and '"content": "' in data and '"content": ""' not in data


def _chat_body(prompt: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
    }


async def _httpx_ttft(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, float]:
    """(request id, client-side TTFT in ms) of one streamed chat request, read to its end so the
    request finishes (rather than being cancelled by the client leaving) before the next one."""
    ttft = None
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=_chat_body(prompt)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and _first_content(line):
                ttft = (time.perf_counter() - started) * 1000
    if ttft is None:
        raise RuntimeError("the stream ended without a content chunk")
    return r.headers["x-lorafleet-request-id"], ttft


async def _raw_ttft(client: RawStreamClient, prompt: str) -> tuple[str, float]:
    """The same request through the minimal client (bench/raw_http.py)."""
    first: list[float] = []

    def on_chunk(chunk: bytes) -> None:
        if not first and _first_content(chunk.decode(errors="replace")):
            first.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    headers = await client.post_stream("/v1/chat/completions", _chat_body(prompt), on_chunk)
    if not first:
        raise RuntimeError("the stream ended without a content chunk")
    return headers["x-lorafleet-request-id"], first[0]


CLIENTS = ("raw", "httpx")


def stack_phase(
    requests: int, warmup: int, spans: bool = True, settle_s: float = 0.05
) -> dict[str, tuple[list[float], list[float]]]:
    """Per client (raw, httpx): client-side TTFTs, and per request that TTFT minus the worker's own
    TTFT for it. The two clients take turns, request by request, in alternating order."""
    root = Path(tempfile.mkdtemp(prefix="lf-bench-"))
    SPANS.parent.mkdir(parents=True, exist_ok=True)
    SPANS.unlink(missing_ok=True)
    nats, redis = start_nats(free_port(), root / "nats"), start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_DB_PATH": str(root / "audit.sqlite3"),
        "LF_LOG_LEVEL": "WARNING",
        "LF_TRACE_EXPORTER": f"file:{SPANS}" if spans else "none",
        **UNLIMITED_QUOTAS,
    }
    if "LF_MODEL_CACHE" in os.environ:
        env["LF_MODEL_CACHE"] = os.environ["LF_MODEL_CACHE"]
    stack = Stack(env, root / "logs")
    try:
        for name in SERVICES:
            stack.start(name)
        asyncio.run(wait_ready(nats.url, stack, SERVICES, 600))

        async def measure() -> dict[str, tuple[list[float], list[float]]]:
            nc = await cli_connect(nats.url)
            worker_ttft: dict[str, float] = {}

            async def on_audit(msg) -> None:
                body = decode(AuditEnvelope, msg.data).body
                if isinstance(body, CompletionAudit):
                    worker_ttft[body.request_id] = body.ttft_ms

            await nc.subscribe(subjects.audit("completion", "bench"), cb=on_audit)
            key = await _tenant_key(nats.url)
            await asyncio.sleep(0.5)  # the gateway's key mirror picks the new key up
            url = f"http://127.0.0.1:{port}"
            timed: dict[str, list[tuple[str, float]]] = {name: [] for name in CLIENTS}
            auth = {"Authorization": f"Bearer {key}"}
            raw = RawStreamClient("127.0.0.1", port, auth)
            async with httpx.AsyncClient(timeout=60, headers=auth) as client:
                for i in range(warmup + requests):
                    for name in CLIENTS if i % 2 == 0 else CLIENTS[::-1]:
                        # Each request starts once the last one's bookkeeping (its completion audit, the
                        # scheduler's release) is done, as the in-process phase's requests do.
                        await asyncio.sleep(settle_s)
                        prompt = PROMPTS[i % len(PROMPTS)]
                        result = await (_raw_ttft(raw, prompt) if name == "raw" else _httpx_ttft(client, url, prompt))
                        if i >= warmup:
                            timed[name].append(result)
            await raw.close()
            await asyncio.sleep(1.0)  # the last completion records arrive
            await nc.drain()
            return {
                name: ([t for _, t in runs], [t - worker_ttft[rid] for rid, t in runs if rid in worker_ttft])
                for name, runs in timed.items()
            }

        return asyncio.run(measure())
    finally:
        stack.stop_all()
        redis.stop()
        nats.stop()


def engine_phase(requests: int, warmup: int, settle_s: float = 0.05) -> list[float]:
    from bench.engine import chat_ids
    from services.worker.engine import EngineRequest
    from services.worker.engine.async_engine import AsyncEngine
    from services.worker.engine.model_loader import load_model
    from services.worker.settings import WorkerSettings

    settings = WorkerSettings()
    loaded = load_model(None, device=settings.engine.device)
    engine = AsyncEngine.from_loaded(loaded, settings.engine)
    engine.start()

    async def ttft(i: int, prompt: str) -> float:
        ids = chat_ids(loaded.tokenizer, prompt)
        req = EngineRequest(
            request_id=f"bench-{i}", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=2, temperature=0)
        )
        started, elapsed = time.perf_counter(), None
        async for out in engine.generate(req):  # to the end, as the stack phase reads its streams
            if out.token_ids and elapsed is None:
                elapsed = (time.perf_counter() - started) * 1000
        if elapsed is None:
            raise RuntimeError(f"request {req.request_id} ended without a token")
        return elapsed

    async def measure() -> list[float]:
        timed = []
        for i in range(warmup + requests):
            await asyncio.sleep(settle_s)
            elapsed = await ttft(i, PROMPTS[i % len(PROMPTS)])
            if i >= warmup:
                timed.append(elapsed)
        return timed

    try:
        return asyncio.run(measure())
    finally:
        engine.shutdown()


def _service_loop() -> str:
    """The event loop the services run on (shared.event_loop picks uvloop where installed)."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def table(result: dict) -> str:
    rows = ["| path | TTFT p50 (ms) | TTFT p95 (ms) | n |", "|---|---:|---:|---:|"]
    for name in CLIENTS:
        p = result["stack"][name]
        rows.append(f"| full stack, {name} client | {p['p50']:.2f} | {p['p95']:.2f} | {p['n']} |")
    e = result["engine"]
    rows.append(f"| AsyncEngine in-process | {e['p50']:.2f} | {e['p95']:.2f} | {e['n']} |")
    for name in CLIENTS:
        o = result["overhead_ms"][name]
        rows.append(f"| unpaired difference ({name} stack - engine) | {o['p50']:.2f} | {o['p95']:.2f} | |")
    for name in CLIENTS:
        p = result["paired_overhead_ms"][name]
        bold = "**" if name == "raw" else ""
        rows.append(
            f"| {bold}paired overhead, {name} client (client TTFT - worker TTFT){bold} | "
            f"{bold}{p['p50']:.2f}{bold} | {bold}{p['p95']:.2f}{bold} | {p['n']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 requests per client and path instead of 200")
    parser.add_argument(
        "--no-spans",
        action="store_true",
        help="services export no spans (the tracing's own cost is out; no per-hop breakdown)",
    )
    parser.add_argument("--stack-only", action="store_true", help="skip the in-process engine phase")
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=50.0,
        help="idle time before each request (0: back to back, overlapping the last one's bookkeeping)",
    )
    args = parser.parse_args()
    requests, warmup = (20, 3) if args.quick else (200, 10)
    runs = stack_phase(requests, warmup, spans=not args.no_spans, settle_s=args.settle_ms / 1000)
    hops = {} if args.no_spans else overhead_breakdown.breakdown(SPANS)
    print(overhead_breakdown.table(hops))
    engine = runs["raw"][0] if args.stack_only else engine_phase(requests, warmup, args.settle_ms / 1000)
    stack = {name: percentiles(ttfts) for name, (ttfts, _) in runs.items()}
    e = percentiles(engine)
    result = {
        "model": MODEL,
        "requests": requests,
        "settle_ms": args.settle_ms,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "event_loop": _service_loop(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
        "stack": stack,
        "engine": e,
        "overhead_ms": {name: {"p50": s["p50"] - e["p50"], "p95": s["p95"] - e["p95"]} for name, s in stack.items()},
        "paired_overhead_ms": {name: percentiles(paired) for name, (_, paired) in runs.items()},
        "hops_ms": hops,
        "load_avg_1m": os.getloadavg()[0],
        "raw_ms": {"engine": engine, **{name: {"stack": t, "paired": p} for name, (t, p) in runs.items()}},
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    markdown = table(result)
    markdown += "\n\nWhere the time before the worker goes (from the services' spans):\n\n" + overhead_breakdown.table(
        hops
    )
    RESULTS.with_suffix(".md").write_text(f"# Gateway TTFT overhead ({MODEL})\n\n{markdown}\n")
    print(markdown)


if __name__ == "__main__":
    main()
