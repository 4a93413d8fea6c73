"""The overhead benchmark's minimal HTTP client against a real uvicorn app: chunks in order,
headers, keep-alive reuse, and a refusal raised rather than timed."""

import asyncio

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

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
