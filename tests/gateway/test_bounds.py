"""Every bound of the gateway, from config, answered with a clear OpenAI-style error."""

import asyncio
import time

import httpx
import pytest

from tests.gateway.conftest import BASE
from tests.gateway.fake_worker import WORKER_ID

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def client(gateway):
    _, key = await gateway.tenant()
    async with gateway.client(key) as c:
        yield c


def error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    if param is not None:
        assert body["param"] == param
    return body["message"]


async def test_body_size_is_413(client):
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": "x" * 300_000})
    assert "exceeds 200000 bytes" in error(r, 413)


async def test_prompt_tokens_over_limit_is_400(client):
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": "word " * 600})
    assert "over the limit of 512" in error(r, 400, "prompt")
    r = await client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "w " * 520}]})
    assert "over the limit of 512" in error(r, 400, "messages")
    assert (await client.post("/v1/completions", json={"model": BASE, "prompt": "word " * 400})).status_code == 200
    # a chat's tools count: the signatures and instructions the template renders are prompt tokens
    chat = {**CHAT, "messages": [{"role": "user", "content": "w " * 300}]}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    parameters = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    r = await client.post("/v1/chat/completions", json={**chat, "tools": tools})
    assert "over the limit of 512" in error(r, 400, "messages")


@pytest.mark.parametrize(
    "extra, param, text",
    [
        ({"max_tokens": 513}, "max_tokens", "exceeds the limit of 512"),
        ({"max_completion_tokens": 513}, "max_tokens", "exceeds the limit of 512"),
        ({"n": 5}, "n", "exceeds the limit of 4"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "exceed the limit of 4"),
        ({"temperature": 2.5}, "temperature", ""),
        ({"top_p": 0}, "top_p", ""),
    ],
)
async def test_sampling_bounds_are_400(client, extra, param, text):
    assert text in error(await client.post("/v1/chat/completions", json={**CHAT, **extra}), 400, param)


async def test_request_timeout_is_504(client):
    started = time.monotonic()
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": "slow please"})
    error(r, 504)
    assert time.monotonic() - started < 4


async def test_quota_refusal_is_429_with_retry_after(client):
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": "quota"})
    assert "requests/min" in error(r, 429)
    assert r.headers["retry-after"] == "3"


async def test_no_worker_is_503(gateway, client):
    gateway.cluster.workers.forget(WORKER_ID)
    r = await client.post("/v1/completions", json={"model": BASE, "prompt": "hi"})
    assert error(r, 503)
    assert r.json()["error"]["code"] == "no_worker_available"


# The disconnect tests run under a long request timeout, so a cancel the worker sees can only be the
# disconnect's, however slowly a loaded machine gets it there.
LONG_TIMEOUT = pytest.mark.parametrize("gateway_over", [{"request_timeout_s": 120}], ids=["timeout_120s"])
CANCEL_WAIT_S = 60  # well inside the request timeout


@LONG_TIMEOUT
async def test_client_disconnect_cancels_the_request_downstream(gateway, client):
    async with client.stream("POST", "/v1/completions", json={"model": BASE, "prompt": "slow", "stream": True}) as r:
        lines = r.aiter_lines()
        for _ in range(6):
            await anext(lines)
    request_id = gateway.worker.requests[-1].request_id
    deadline = time.monotonic() + CANCEL_WAIT_S
    while request_id not in gateway.worker.cancelled:
        assert time.monotonic() < deadline, "the worker was never told to cancel"
        await asyncio.sleep(0.02)


@LONG_TIMEOUT
async def test_client_disconnect_cancels_a_non_streamed_request_downstream(gateway, client):
    before = len(gateway.worker.requests)
    call = asyncio.create_task(client.post("/v1/completions", json={"model": BASE, "prompt": "slow"}))
    deadline = time.monotonic() + CANCEL_WAIT_S
    while len(gateway.worker.requests) == before:  # accepted and generating on the worker
        assert time.monotonic() < deadline, "the request never reached the worker"
        await asyncio.sleep(0.02)
    request_id = gateway.worker.requests[-1].request_id
    await asyncio.sleep(0.1)
    call.cancel()  # the client gives up: httpx closes the connection
    with pytest.raises(asyncio.CancelledError):
        await call
    deadline = time.monotonic() + CANCEL_WAIT_S
    while request_id not in gateway.worker.cancelled:
        assert time.monotonic() < deadline, "the worker was not told to cancel when the client left"
        await asyncio.sleep(0.02)


async def test_a_reply_naming_another_request_never_reaches_the_stream(gateway, client):
    from shared.bus import encode
    from shared.schemas import ReplyEnvelope, ReplyToken

    async with client.stream("POST", "/v1/completions", json={"model": BASE, "prompt": "slow", "stream": True}) as r:
        lines = r.aiter_lines()
        await anext(lines)
        inbox = gateway.worker.requests[-1].reply_to
        forged = ReplyToken(request_id="someone-else", index=0, text=" INJECTED", token_ids=[1])
        for _ in range(3):
            await gateway.nc.publish(inbox, encode(ReplyEnvelope(body=forged)))
        seen = [await anext(lines) for _ in range(20)]
    assert any(" t" in line for line in seen)  # the real tokens flow
    assert not any("INJECTED" in line for line in seen)


async def test_a_gap_in_the_reply_stream_fails_the_request_instead_of_dropping_text(gateway, client):
    from shared.bus import encode
    from shared.schemas import ReplyEnvelope, ReplyToken

    async with client.stream("POST", "/v1/completions", json={"model": BASE, "prompt": "slow", "stream": True}) as r:
        lines = r.aiter_lines()
        await anext(lines)
        request = gateway.worker.requests[-1]
        skipped = ReplyToken(request_id=request.request_id, index=450, text=" t450", token_ids=[450])
        await gateway.nc.publish(request.reply_to, encode(ReplyEnvelope(body=skipped)))
        rest = [line async for line in lines]
    assert not any("t450" in line for line in rest)
    assert any('"code": "service_unavailable"' in line and "lost tokens" in line for line in rest), rest[-3:]
    deadline = time.monotonic() + 1
    while request.request_id not in gateway.worker.cancelled:  # and the worker stops generating it
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def nested(depth: int) -> dict:
    """A valid JSON schema whose objects nest ``depth`` deep or one less (two per property level, and the leaf)."""
    schema: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}


@pytest.mark.parametrize("depth", [100, 400])
async def test_a_schema_past_the_depth_bound_is_a_json_400_not_a_traceback(client, depth):
    r = await client.post("/v1/chat/completions", json={**CHAT, "response_format": schema_format(nested(depth))})
    assert "nests deeper than 32 levels" in error(r, 400, "response_format")
    assert r.json()["error"]["code"] == "schema_too_large"
    tools = [{"type": "function", "function": {"name": "f", "parameters": nested(depth)}}]
    r = await client.post("/v1/chat/completions", json={**CHAT, "tools": tools})
    assert "nests deeper than 32 levels" in error(r, 400, "tools")
    assert r.json()["error"]["code"] == "schema_too_large"


async def test_a_schema_past_the_size_bound_is_a_json_400(client):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(6000)}}
    r = await client.post("/v1/chat/completions", json={**CHAT, "response_format": schema_format(wide)})
    assert "more than 10000 values" in error(r, 400, "response_format")
    assert r.json()["error"]["code"] == "schema_too_large"


async def test_a_schema_within_the_bounds_is_served(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "response_format": schema_format(nested(32))})
    assert r.status_code == 200, r.text
