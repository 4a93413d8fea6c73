"""Traces span the services of one request; every service exposes its metrics."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import nats
import openai
from prometheus_client.parser import text_string_to_metric_families

from shared import subjects
from shared.bus import decode, request
from shared.schemas import (
    DispatchReply,
    InferRequest,
    ReplyEnvelope,
    ReplyFinal,
    SamplingParams,
    ServiceHeartbeat,
    WorkerHeartbeat,
)

MODEL = "SmolLM2-135M-Instruct"


def _spans(path) -> list[dict]:
    # the services append while the test reads: a last line without its newline is still being written
    lines = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def test_one_request_is_one_trace_across_three_services(running_stack):
    client = openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=3)
    request_id = raw.headers["x-lorafleet-request-id"]
    deadline = time.monotonic() + 10
    services: set[str] = set()
    while time.monotonic() < deadline and not {"gateway", "scheduler", "worker"} <= services:
        spans = _spans(running_stack.spans_path)
        roots = [
            s for s in spans if s["attributes"].get("lf.request_id") == request_id and s["name"] == "gateway.request"
        ]
        if roots:
            trace_id = roots[0]["context"]["trace_id"]
            services = {
                s["resource"]["attributes"]["service.name"].removeprefix("lorafleet-")
                for s in spans
                if s["context"]["trace_id"] == trace_id
            }
        time.sleep(0.3)
    assert {"gateway", "scheduler", "worker"} <= services


async def _metrics_ports(nats_url: str) -> dict[str, int]:
    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.SERVICE_HEARTBEAT_ALL)
    ports: dict[str, int] = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not {"worker", "scheduler", "auditor"} <= set(ports):
        beat = decode(ServiceHeartbeat, (await sub.next_msg(timeout=5)).data)
        if beat.metrics_port:
            ports[beat.service] = beat.metrics_port
    await nc.close()
    return ports


def test_metrics_families_have_values_after_traffic(running_stack):
    client = openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
    ports = asyncio.run(_metrics_ports(running_stack.nats.url))
    assert {"worker", "scheduler", "auditor"} <= set(ports)
    worker = httpx.get(f"http://127.0.0.1:{ports['worker']}/metrics", headers=running_stack.worker_metrics_headers).text
    for family in (
        "ttft_ms_bucket",
        "tpot_ms_bucket",
        "adapter_tokens_total",
        "requests_total",
        "kv_cache_usage_ratio",
        "running_requests",
    ):
        assert family in worker, family
    assert 'ttft_ms_count{cache_hit="true"}' in worker
    # a base-model request's TTFT / TPOT by rank class: no adapter, no class
    assert 'rank_class_ttft_ms_count{rank_class="base"}' in worker
    assert 'rank_class_tpot_ms_count{rank_class="base"}' in worker
    deadline = time.monotonic() + 10  # the prefix-cache counters are brought up to date at each heartbeat
    while "prefix_cache_queried_tokens_total 0.0" in worker and time.monotonic() < deadline:
        time.sleep(0.5)
        worker = httpx.get(
            f"http://127.0.0.1:{ports['worker']}/metrics", headers=running_stack.worker_metrics_headers
        ).text
    assert "prefix_cache_hit_tokens_total" in worker
    assert "prefix_cache_queried_tokens_total 0.0" not in worker and "prefix_cache_queried_tokens_total" in worker
    gateway = httpx.get(f"{running_stack.gateway_url}/metrics").text
    assert "admission_rejections_total" in gateway


def _listen_address(port: int) -> str:
    """The local address the TCP listener on ``port`` is bound to, from /proc/net/tcp (hex, as the kernel writes it)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            return address
    raise AssertionError(f"nothing listens on port {port}")


def test_worker_metrics_bind_where_configured_and_time_steps_by_rank_mix(running_stack):
    """The worker's LF_METRICS_HOST/LF_METRICS_PORT (0.0.0.0 on a chosen port, as in compose) are honoured,
    and engine_step_time_ms carries a rank_mix label once it has served."""
    client = openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
    port = running_stack.worker_metrics_port
    assert asyncio.run(_metrics_ports(running_stack.nats.url))["worker"] == port
    assert _listen_address(port) == "00000000"  # 0.0.0.0, not 127.0.0.1 (0100007F)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=running_stack.worker_metrics_headers).text
    steps = {
        sample.labels["rank_mix"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "engine_step_time_ms_count"
    }
    assert steps.get("base", 0) >= 4, steps  # one step per generated token of the base-model request at least
    ttft = [
        sample
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "adapter_ttft_ms_count"
    ]
    assert any(sample.labels["adapter"] == "base" and sample.value >= 1 for sample in ttft), ttft


async def _dispatch_with_targets(nats_url: str) -> set[str]:
    """Two requests straight to the worker as the scheduler dispatches them, class and TTFT target set:
    an interactive one with a target it meets, a batch one with a target no request can meet."""
    nc = await nats.connect(nats_url)
    beats = await nc.subscribe(subjects.WORKER_HEARTBEAT)
    beat = decode(WorkerHeartbeat, (await beats.next_msg(timeout=10)).data)
    finals: set[str] = set()
    done = asyncio.Event()

    async def on_reply(msg) -> None:
        body = decode(ReplyEnvelope, msg.data).body
        if isinstance(body, ReplyFinal):
            finals.add(body.request_id)
            if len(finals) == 2:
                done.set()

    await nc.subscribe("_INBOX.slo.>", cb=on_reply)
    for rid, slo_class, target_s in (("slo-met", "interactive", 600.0), ("slo-missed", "batch", 1e-3)):
        dispatch = InferRequest(
            request_id=rid,
            tenant_id="demo",
            model=MODEL,
            base_model=beat.base_model,
            prompt="Hello there",
            reply_to=f"_INBOX.slo.{rid}",
            sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            priority=slo_class,
            ttft_target_s=target_s,
        )
        reply = await request(nc, subjects.worker_dispatch(beat.worker_id), dispatch, DispatchReply, timeout=10)
        assert reply.accepted, reply
    await asyncio.wait_for(done.wait(), timeout=120)
    await nc.close()
    return finals


def test_slo_families_by_class_on_a_worker_scrape(running_stack):
    """slo_ttft_ms, slo_tpot_ms, slo_requests (met, missed) and slo_attainment_ratio by class; a request
    through the gateway is measured under its tenant's class (standard)."""
    client = openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
    assert asyncio.run(_dispatch_with_targets(running_stack.nats.url)) == {"slo-met", "slo-missed"}
    text = httpx.get(
        f"http://127.0.0.1:{running_stack.worker_metrics_port}/metrics", headers=running_stack.worker_metrics_headers
    ).text
    values = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }

    def value(name: str, **labels: str) -> float | None:
        return values.get((name, tuple(sorted(labels.items()))))

    for slo_class in ("interactive", "batch", "standard"):
        assert (value("slo_ttft_ms_count", slo_class=slo_class) or 0) >= 1, slo_class
        assert (value("slo_tpot_ms_count", slo_class=slo_class) or 0) >= 1, slo_class
    assert value("slo_requests_total", slo_class="interactive", outcome="met") == 1
    assert value("slo_requests_total", slo_class="batch", outcome="missed") == 1
    assert value("slo_attainment_ratio", slo_class="interactive") == 1.0
    assert value("slo_attainment_ratio", slo_class="batch") == 0.0
