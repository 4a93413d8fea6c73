"""bench.load: the schedule's statistics, the report's percentiles, the client's classification of
every request (against stub servers: httpx.MockTransport), and one short run on a real stack."""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.load import stack as load_stack
from bench.load.cli import DEFAULTS, add_load_options, config_from, loopback_url
from bench.load.client import Outcome, run_open_loop, send
from bench.load.report import percentiles, summarize
from bench.load.traffic import Arrival, Population, poisson_times, popularity_order, schedule, zipf_weights

REPO = Path(__file__).resolve().parents[2]
POPULATION = Population("base", ("t0", "t1", "t2"), tuple((f"a{i:02d}", f"t{i % 3}") for i in range(50)))


def plan(**overrides) -> list[Arrival]:
    options = {"rate": 50.0, "count": 20_000, "duration_s": 1e9, "zipf_s": 1.1, "base_share": 0.1, "seed": 7}
    options |= overrides
    return schedule(POPULATION, **options)


def test_poisson_arrivals_keep_the_mean_rate_and_exponential_gaps():
    times = poisson_times(5.0, 20_000, 1e9, random.Random(1))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]  # each gap: the one before
    assert len(times) / times[-1] == pytest.approx(5.0, rel=0.03)
    cv = (sum((g - 0.2) ** 2 for g in gaps) / len(gaps)) ** 0.5 / 0.2  # exponential: std == mean
    assert cv == pytest.approx(1.0, abs=0.05)


def test_a_run_stops_at_the_count_or_the_duration_whichever_comes_first():
    assert len(plan(count=10)) == 10
    by_time = plan(rate=5.0, count=1_000_000, duration_s=10.0)
    assert all(a.at_s < 10.0 for a in by_time) and 30 <= len(by_time) <= 75
    assert [a.at_s for a in by_time] == sorted(a.at_s for a in by_time)


def test_adapter_popularity_follows_zipf_over_the_popularity_order():
    arrivals = plan(base_share=0.0)
    counts = Counter(a.model for a in arrivals)
    ranked = [adapter for adapter, _ in popularity_order(POPULATION.adapters, 7)]
    frequencies = [counts[a] for a in ranked]
    assert frequencies[:5] == sorted(frequencies[:5], reverse=True)
    assert sum(frequencies[:10]) > sum(frequencies[10:30]) > sum(frequencies[30:])
    expected = zipf_weights(50, 1.1)
    assert frequencies[0] / len(arrivals) == pytest.approx(expected[0], rel=0.05)
    assert frequencies[9] / len(arrivals) == pytest.approx(expected[9], rel=0.15)


def test_each_tenant_asks_for_its_own_adapters_or_the_base_model():
    arrivals = plan(count=5_000)
    owner = dict(POPULATION.adapters)
    base = [a for a in arrivals if a.model == "base"]
    assert all(owner[a.model] == a.tenant for a in arrivals if a.model != "base")
    assert len(base) / len(arrivals) == pytest.approx(0.1, abs=0.02)
    assert {a.tenant for a in base} == set(POPULATION.tenants)


def test_the_schedule_is_a_function_of_the_seed():
    assert plan(count=500) == plan(count=500)
    assert plan(count=500) != plan(count=500, seed=8)


def test_percentiles_are_nearest_rank():
    assert percentiles([float(v) for v in range(100, 0, -1)]) == {"p50": 50.0, "p95": 95.0, "p99": 99.0, "n": 100}
    assert percentiles([3.0]) == {"p50": 3.0, "p95": 3.0, "p99": 3.0, "n": 1}
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None, "n": 0}


def outcome(i: int, status: str, **fields) -> Outcome:
    return Outcome(i, "t0", fields.pop("model", "a00"), status, fields.pop("code", None), 0.0, 0.0, **fields)


def test_summary_counts_each_request_once_and_splits_latency_by_cache_hit():
    outcomes = [
        outcome(0, "completed", ttft_ms=10.0, tpot_ms=1.0, tokens=4, cache_hit=True, adapter="a00"),
        outcome(1, "completed", ttft_ms=30.0, tpot_ms=2.0, tokens=4, cache_hit=False, adapter="a00"),
        outcome(2, "completed", ttft_ms=20.0, tpot_ms=1.0, tokens=4, cache_hit=True, adapter="", model="base"),
        outcome(3, "error", code="quota_exceeded"),
        outcome(4, "lost", code="timeout"),
    ]
    s = summarize(outcomes, wall_s=2.0)
    assert (s["requests"], s["completed"], s["errors"], s["lost"]) == (5, 3, 1, 1)
    assert s["errors_by_code"] == {"quota_exceeded": 1} and s["lost_by_reason"] == {"timeout": 1}
    assert (s["ttft_ms"]["hit"]["p50"], s["ttft_ms"]["miss"]["p50"], s["ttft_ms"]["base"]["p50"]) == (10.0, 30.0, 20.0)
    assert s["ttft_p95_ms"] == 30.0 and s["cache_hit_rate"] == 0.5
    assert s["per_adapter"]["a00"] == {
        "requests": 4,
        "completed": 2,
        "tokens": 8,
        "hits": 1,
        "req_s": 1.0,
        "tok_s": 4.0,
    }


def test_only_loopback_targets_are_accepted():
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000", "http://127.0.0.2:1"):
        assert loopback_url(url) == url.rstrip("/")
    for url in ("http://10.0.0.1:8000", "http://example.com", "https://8.8.8.8", "ftp://127.0.0.1", "127.0.0.1:80"):
        with pytest.raises(ValueError, match="loopback"):
            loopback_url(url)


HEADERS = {
    "x-lorafleet-cache-hit": "false",
    "x-lorafleet-adapter": "a00",
    "x-lorafleet-worker": "w1",
    "content-type": "text/event-stream",
}


def sse(*events: dict | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def chunk(content: str | None = None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


TOKENS = [chunk("Hello"), chunk(" there"), chunk(" friend")]
COMPLETE = sse(
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    *TOKENS,
    chunk(finish="length"),
    {"choices": [], "usage": {"completion_tokens": 3}},
    "[DONE]",
)


def streaming(lines: list[bytes], status: int = 200, pause_s: float = 0.0, hang_after: int | None = None):
    """A stub gateway answering every request with ``lines``; it may pause between them or hang."""

    async def body():
        for i, line in enumerate(lines):
            if i == hang_after:
                await asyncio.sleep(3600)
            await asyncio.sleep(pause_s)
            yield line

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers=HEADERS, content=body())

    return httpx.MockTransport(handler)


async def one(transport: httpx.MockTransport, timeout_s: float = 5.0) -> Outcome:
    async with httpx.AsyncClient(base_url="http://127.0.0.1:1", transport=transport) as client:
        return await send(client, "key", Arrival(0, 0.0, "t0", "a00", "hi"), max_tokens=3, timeout_s=timeout_s)


async def test_a_finished_stream_is_completed_with_its_timings():
    out = await one(streaming(COMPLETE, pause_s=0.02))
    assert (out.status, out.code, out.tokens, out.cache_hit, out.adapter, out.worker) == (
        "completed",
        None,
        3,
        False,
        "a00",
        "w1",
    )
    assert 15 <= out.ttft_ms < out.latency_ms and 15 <= out.tpot_ms < 200


async def test_an_error_answer_is_an_error_by_its_code():
    refused = [json.dumps({"error": {"code": "quota_exceeded", "type": "rate_limit_error"}}).encode()]
    out = await one(streaming(refused, status=429))
    assert (out.status, out.code) == ("error", "quota_exceeded")
    assert (await one(streaming([b"<html>bad gateway</html>"], status=502))).code == "http_502"


async def test_an_error_event_in_the_stream_is_an_error():
    lines = sse(TOKENS[0], {"error": {"code": "worker_lost", "type": "server_error"}}, "[DONE]")
    assert (await one(streaming(lines))).code == "worker_lost"


async def test_a_stream_that_ends_without_a_finish_is_lost():
    out = await one(streaming(sse(*TOKENS)))
    assert (out.status, out.code) == ("lost", "no_finish")


async def test_no_answer_within_the_timeout_is_lost():
    out = await one(streaming(COMPLETE, hang_after=2), timeout_s=0.3)
    assert (out.status, out.code) == ("lost", "timeout")


async def test_no_connection_is_an_error():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    out = await one(httpx.MockTransport(refuse))
    assert (out.status, out.code) == ("error", "ConnectError")


async def test_requests_go_out_on_schedule_whatever_is_in_flight():
    arrivals = [Arrival(i, 0.05 * i, "t0", "a00", "hi") for i in range(8)]
    started = time.perf_counter()
    outcomes, _ = await run_open_loop(
        ["http://127.0.0.1:1"],
        {"t0": "key"},
        arrivals,
        max_tokens=3,
        timeout_s=5,
        drain_s=5,
        transport=streaming(COMPLETE, pause_s=0.1),
    )
    assert time.perf_counter() - started < 1.5  # closed loop would take 8 x 0.6 s
    assert [o.status for o in outcomes] == ["completed"] * 8
    assert max(o.lag_ms for o in outcomes) < 100


async def test_requests_still_running_when_the_drain_ends_are_lost():
    arrivals = [Arrival(i, 0.0, "t0", "a00", "hi") for i in range(3)]
    outcomes, wall_s = await run_open_loop(
        ["http://127.0.0.1:1"],
        {"t0": "key"},
        arrivals,
        max_tokens=3,
        timeout_s=60,
        drain_s=0.3,
        transport=streaming(COMPLETE, hang_after=1),
    )
    assert wall_s < 2 and [(o.status, o.code) for o in outcomes] == [("lost", "unfinished_at_drain")] * 3


async def _served(
    handler: Callable[[httpx.Request], Awaitable[httpx.Response]],
    arrivals: list[Arrival],
    gateways: list[str] | None = None,
    **options: Any,
) -> list[Outcome]:
    """``arrivals`` run open loop against ``handler`` (on every gateway), each asking 3 tokens."""
    outcomes, _ = await run_open_loop(
        gateways or ["http://127.0.0.1:1"],
        {"t0": "key"},
        arrivals,
        max_tokens=3,
        timeout_s=5,
        drain_s=5,
        transport=httpx.MockTransport(handler),
        **options,
    )
    return outcomes


async def test_arrivals_go_to_each_gateway_in_turn():
    seen: list[int | None] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.port)
        return httpx.Response(200, headers=HEADERS, content=b"".join(COMPLETE))

    arrivals = [Arrival(i, 0.0, "t0", "a00", "hi") for i in range(6)]
    outcomes = await _served(handler, arrivals, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert [o.status for o in outcomes] == ["completed"] * 6
    assert Counter(seen) == {1: 3, 2: 3}


async def test_each_arrival_carries_the_peer_fields_given_for_it():
    bodies: list[dict] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, headers=HEADERS, content=b"".join(COMPLETE))

    arrivals = [Arrival(i, 0.0, "t0", f"a{i:02d}", "hi") for i in range(3)]
    outcomes = await _served(
        handler, arrivals, extra=lambda a: {"model": "base", "lora": [{"id": a.index, "scale": 1.0}]}
    )
    assert [o.status for o in outcomes] == ["completed"] * 3
    assert sorted((b["model"], b["lora"][0]["id"], b["stream"]) for b in bodies) == [
        ("base", 0, True), ("base", 1, True), ("base", 2, True),
    ]  # fmt: skip


def test_a_nats_fault_needs_the_cluster_shape_and_a_time_inside_the_run():
    assert config_from(parsed("--shape", "cluster", "--kill-nats-at-s", "10")).kill_nats_at_s == 10
    with pytest.raises(ValueError, match="cluster"):
        config_from(parsed("--kill-nats-at-s", "10"))
    with pytest.raises(ValueError, match="inside the run"):
        config_from(parsed("--shape", "cluster", "--kill-nats-at-s", "900", "--duration-s", "60"))
    with pytest.raises(ValueError, match="not with --url"):
        config_from(parsed("--shape", "cluster", "--url", "http://127.0.0.1:8000", "--key", "k"))


@pytest.mark.slow
def test_a_short_run_on_the_tiny_model_completes_every_request(tmp_path):
    out = tmp_path / "load.json"
    args = ["--quick", "--engine", "builtin", "--count", "20", "--adapters", "20", "--tenants", "2", "--rate", "5"]
    args += ["--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "bench.load", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=240,
        env={**os.environ, "LF_LOG_LEVEL": "WARNING"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in (
        "ttft_p50_ms",
        "ttft_p95_ms",
        "ttft_p99_ms",
        "tpot_p95_ms",
        "lost",
        "errors_by_code",
        "cache_hit_rate",
        "throughput_tok_s",
        "summary",
        "registration",
        "environment",
    ):
        assert key in result, key
    assert result["lost"] == 0 and result["completed"] > 0 and result["requests"] == 20
    assert result["adapters_registered"] == 20 and result["registration"]["adapters"] == 20
    assert result["config"]["engine"] == result["environment"]["engine"] == "builtin"
    assert set(result["summary"]["ttft_ms"]) == {"all", "hit", "miss", "base"}
    assert out.with_suffix(".md").is_file() and out.with_suffix(".png").stat().st_size > 0


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_load_options(parser)
    return parser.parse_args(list(argv))


def test_the_engine_defaults_to_builtin_and_vllm_is_refused_where_it_cannot_run(monkeypatch, tmp_path):
    assert DEFAULTS.engine == "builtin" and config_from(parsed()).engine == "builtin"
    monkeypatch.setattr("bench.load.cli.VLLM_PYTHON", tmp_path / "missing" / "python")
    with pytest.raises(ValueError, match="make venv-vllm"):
        config_from(parsed("--engine", "vllm", "--base-model", "smollm2"))
    (tmp_path / "python").touch()
    monkeypatch.setattr("bench.load.cli.VLLM_PYTHON", tmp_path / "python")
    assert config_from(parsed("--engine", "vllm", "--base-model", "tiny-h64")).engine == "vllm"
    with pytest.raises(ValueError, match="head size 16"):
        config_from(parsed("--engine", "vllm", "--base-model", "tiny"))
    with pytest.raises(ValueError, match="not with --url"):
        config_from(parsed("--engine", "vllm", "--url", "http://127.0.0.1:8000", "--key", "k"))


def test_a_vllm_worker_runs_under_the_vllm_interpreter_importing_this_checkout(monkeypatch, tmp_path):
    assert load_stack.worker_launch("builtin") == (None, {"LF_WORKER_ENGINE": "builtin"})
    (tmp_path / "python").touch()
    monkeypatch.setattr(load_stack, "VLLM_PYTHON", tmp_path / "python")
    python, env = load_stack.worker_launch("vllm")
    assert python == str(tmp_path / "python")
    assert env == {"LF_WORKER_ENGINE": "vllm", "PYTHONPATH": str(REPO)}
    assert (REPO / "services" / "worker" / "__main__.py").is_file()  # what `-m services.worker` finds there
    with pytest.raises(ValueError, match="unknown worker engine"):
        load_stack.worker_launch("tgi")
