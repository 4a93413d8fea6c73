"""Hostile grammars: a short regex ``pattern`` whose automaton takes xgrammar minutes to build is
refused (400 grammar_too_complex) at the worker's compile bound while another tenant's requests on the
same worker are served; a JSON schema nested past the gateway's depth bound is a JSON 400, never a
traceback."""

import asyncio
import statistics
import time

import httpx

from tests.hostile.conftest import GRAMMAR_BOUND_S, MODEL, HostileStack
from tests.hostile.test_http_hostile import assert_error
from tests.worker.engine.test_grammar_pool import HOSTILE

CHAT = "/v1/chat/completions"
SLACK_S = 4.0  # the request's hops, and killing the compile child and starting its replacement, on a shared box
NEIGHBOUR = {"model": MODEL, "prompt": "Hello", "max_tokens": 8}


def structured(schema: dict) -> dict:
    format_ = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "response_format": format_,
    }


async def timed(client: httpx.AsyncClient, path: str, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = await client.post(path, json=body)
    return r, time.monotonic() - started


async def neighbour_latencies(client: httpx.AsyncClient, count: int) -> list[float]:
    latencies = []
    for _ in range(count):
        r, seconds = await timed(client, "/v1/completions", NEIGHBOUR)
        assert r.status_code == 200, r.text
        latencies.append(seconds)
    return latencies


async def test_a_hostile_pattern_is_refused_at_the_bound_while_a_neighbour_is_served(hostile: HostileStack) -> None:
    async with hostile.client(hostile.keys.other) as evil, hostile.client(hostile.keys.demo) as neighbour:
        alone = await neighbour_latencies(neighbour, 5)
        json_mode = {**structured({"type": "object"}), "response_format": {"type": "json_object"}}
        r, _ = await timed(neighbour, CHAT, json_mode)  # the compile children are up before the clock starts
        assert r.status_code == 200, r.text
        attack = asyncio.create_task(timed(evil, CHAT, structured(HOSTILE)))
        await asyncio.sleep(0.5)  # the hostile compile runs on the worker now
        beside = await neighbour_latencies(neighbour, 5)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        constrained, constrained_s = await timed(neighbour, CHAT, structured(schema))  # the other compile child
        assert not attack.done(), "the hostile compile ended before its bound: the pattern is not hostile here"
        refused, refused_s = await attack
    error = assert_error(refused, 400, "grammar_too_complex", "response_format")
    assert "takes too long to compile" in error["message"]
    assert GRAMMAR_BOUND_S <= refused_s < GRAMMAR_BOUND_S + SLACK_S
    assert constrained.status_code == 200, constrained.text
    assert constrained_s < GRAMMAR_BOUND_S
    assert statistics.median(beside) < GRAMMAR_BOUND_S
    print(
        f"\nneighbour p50 alone {statistics.median(alone) * 1000:.0f} ms, beside the hostile compile "
        f"{statistics.median(beside) * 1000:.0f} ms; its structured request {constrained_s * 1000:.0f} ms; "
        f"hostile refused after {refused_s * 1000:.0f} ms (bound {GRAMMAR_BOUND_S * 1000:.0f} ms)"
    )
    # the tenant's retry is refused at once, from its own cache on the worker
    async with hostile.client(hostile.keys.other) as evil:
        again, again_s = await timed(evil, CHAT, structured(HOSTILE))
    assert_error(again, 400, "grammar_too_complex", "response_format")
    assert again_s < GRAMMAR_BOUND_S
    await hostile.assert_alive()


def deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


async def test_a_deep_schema_is_a_json_400(hostile: HostileStack) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep_schema(100)}}]
    async with hostile.client(hostile.keys.demo) as c:
        r = await c.post(CHAT, json=structured(deep_schema(100)))
        assert_error(r, 400, "schema_too_large", "response_format")
        r = await c.post(CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools})
        assert_error(r, 400, "schema_too_large", "tools")
        assert len(r.content) < 1000
    await hostile.assert_alive()
