"""The overhead benchmark's minimal HTTP client against a real uvicorn app: chunks in order,
headers, keep-alive reuse, and a refusal raised rather than timed; and the one-user benches' request
over it (``send_raw``)."""

import asyncio
import json

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.load.client import send_raw
from bench.load.traffic import Arrival
from bench.raw_http import RawStreamClient
from lorafleet.cli.infra import free_port


@pytest.fixture
async def server():
    app = FastAPI()
    connections: set = set()

    @app.post("/stream")
    async def stream(request: Request):
        body = await request.json()
        connections.add(request.client.port)
        if body.get("refuse"):
            return JSONResponse({"error": "no"}, status_code=429)

        async def chunks():
            for i in range(body["n"]):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.001)

        return StreamingResponse(chunks(), headers={"x-id": str(body["n"])}, media_type="text/event-stream")

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(uv.serve())
    while not uv.started:  # noqa: ASYNC110 - uvicorn exposes only a flag, no event, for its start
        await asyncio.sleep(0.01)
    yield port, connections
    uv.should_exit = True
    await task


async def test_chunks_headers_and_keep_alive(server):
    port, connections = server
    client = RawStreamClient("127.0.0.1", port, {"Authorization": "Bearer x"})
    for n in (3, 5):
        seen: list[bytes] = []
        headers = await client.post_stream("/stream", {"n": n}, seen.append)
        assert b"".join(seen) == "".join(f"data: {i}\n\n" for i in range(n)).encode()
        assert headers["x-id"] == str(n)
    assert len(connections) == 1  # both requests on one connection
    with pytest.raises(RuntimeError, match="HTTP 429"):
        await client.post_stream("/stream", {"refuse": True}, seen.append)
    await client.close()


@pytest.fixture
async def chat_server():
    """An OpenAI-shaped stream: events split across chunks and joined in one, then finish and usage."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        if body["model"] == "refused":
            return JSONResponse({"error": {"code": "quota_exceeded"}}, status_code=429)
        n = body["max_tokens"]
        events = [{"choices": [{"delta": {"content": f"t{i} "}}]} for i in range(n)]
        events += [
            {"choices": [{"delta": {}, "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": n}},
        ]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

        async def chunks():
            for start in range(0, len(text), 37):  # cut anywhere: mid-event, mid-line, several events at once
                yield text[start : start + 37]
                await asyncio.sleep(0.001)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(uv.serve())
    while not uv.started:  # noqa: ASYNC110 - uvicorn exposes only a flag, no event, for its start
        await asyncio.sleep(0.01)
    yield port
    uv.should_exit = True
    await task


async def test_send_raw_times_and_counts_a_stream_cut_anywhere_and_reports_a_refusal(chat_server):
    client = RawStreamClient("127.0.0.1", chat_server, {"Authorization": "Bearer x"})
    try:
        out = await send_raw(client, Arrival(0, 0.0, "t", "m", "hi"), max_tokens=12, timeout_s=30)
        assert out.status == "completed" and out.tokens == 12
        assert out.ttft_ms is not None and out.tpot_ms is not None and out.latency_ms is not None
        assert 0 < out.ttft_ms <= out.latency_ms and out.tpot_ms > 0
        refused = await send_raw(client, Arrival(1, 0.0, "t", "refused", "hi"), max_tokens=4, timeout_s=30)
        assert refused.status == "error" and "HTTP 429" in (refused.code or "")
        again = await send_raw(client, Arrival(2, 0.0, "t", "m", "hi"), max_tokens=3, timeout_s=30)
        assert again.status == "completed" and again.tokens == 3  # a new connection after the refusal
    finally:
        await client.close()
