"""Fire a schedule open loop against the OpenAI-compatible API; classify every request.

Each request ends as exactly one of: ``completed`` (a finish reason arrived), ``error`` (an HTTP
error answer, an error event in the stream, or no connection), or ``lost`` (no answer within the
client timeout, or a stream that ended without a finish). Lost is what a serving platform must
never produce: every request it accepts ends served or with an error, within its own bound.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import httpx

from bench.load.traffic import Arrival
from bench.raw_http import RawStreamClient

Status = Literal["completed", "error", "lost"]


@dataclass(slots=True)
class Outcome:
    index: int
    tenant: str
    model: str
    status: Status
    code: str | None  # the error code, or why the request was lost
    at_s: float  # scheduled offset from the start of the run
    lag_ms: float  # how late the generator sent it
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    latency_ms: float | None = None
    tokens: int = 0
    cache_hit: bool | None = None
    adapter: str | None = None  # as the gateway served it ("" = the base model)
    worker: str | None = None
    priority: str | None = None  # the SLO class it asked for
    retry_after_s: float | None = None  # a refusal's Retry-After


@dataclass(slots=True)
class _Stream:
    """What one streamed answer has shown so far."""

    first_token: float | None = None
    last_token: float | None = None
    chunks: int = 0
    tokens: int | None = None  # from the usage chunk
    finished: bool = False
    error: str | None = None

    def feed(self, data: str, now: float) -> None:
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            self.error = str(event["error"].get("code") or event["error"].get("type") or "stream_error")
            return
        if event.get("usage"):
            self.tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices", ()):
            if choice.get("delta", {}).get("content"):
                self.first_token = self.first_token or now
                self.last_token = now
                self.chunks += 1
            if choice.get("finish_reason"):
                self.finished = True


def _error_code(status: int, body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{status}"


def chat_body(arrival: Arrival, max_tokens: int, extra: dict | None = None) -> dict:
    """Greedy, EOS ignored: every request generates exactly ``max_tokens`` tokens; ``extra`` adds a
    server's own fields (llama-server's per-request ``lora``)."""
    body = {
        "model": arrival.model,
        "messages": [{"role": "user", "content": arrival.prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if arrival.priority is not None:
        body["priority"] = arrival.priority
    return body | (extra or {})


async def send(
    client: httpx.AsyncClient,
    key: str,
    arrival: Arrival,
    *,
    max_tokens: int,
    timeout_s: float,
    lag_ms: float = 0.0,
    extra: dict | None = None,
) -> Outcome:
    """One streamed chat request, bounded by ``timeout_s`` end to end."""
    out = Outcome(
        arrival.index, arrival.tenant, arrival.model, "lost", None, arrival.at_s, lag_ms, priority=arrival.priority
    )
    stream = _Stream()
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json=chat_body(arrival, max_tokens, extra),
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                out.adapter = r.headers.get("x-lorafleet-adapter")
                out.worker = r.headers.get("x-lorafleet-worker")
                if "x-lorafleet-cache-hit" in r.headers:
                    out.cache_hit = r.headers["x-lorafleet-cache-hit"] == "true"
                if r.status_code != 200:
                    out.status, out.code = "error", _error_code(r.status_code, await r.aread())
                    out.latency_ms = (time.perf_counter() - started) * 1000  # how long a refusal took
                    if "retry-after" in r.headers:
                        out.retry_after_s = float(r.headers["retry-after"])
                    return out
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        stream.feed(line[6:], time.perf_counter())
    except (TimeoutError, httpx.TimeoutException):
        out.code = "timeout"
        return out
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as e:
        out.status, out.code = "error", type(e).__name__
        return out
    except (httpx.RequestError, json.JSONDecodeError) as e:
        out.code = f"broken_stream:{type(e).__name__}"
        return out
    return _classify(out, stream, started, time.perf_counter())


async def send_raw(
    client: RawStreamClient, arrival: Arrival, *, max_tokens: int, timeout_s: float, extra: dict | None = None
) -> Outcome:
    """``send``'s request and classification through ``bench.raw_http``'s client (prebuilt bytes, chunks
    scanned for SSE lines): what a one-user benchmark times is then the server's, not httpx's own
    millisecond or so per request and its CPU per token on the same two cores."""
    out = Outcome(arrival.index, arrival.tenant, arrival.model, "lost", None, arrival.at_s, 0.0)
    stream, pending = _Stream(), bytearray()

    def on_chunk(chunk: bytes) -> None:
        pending.extend(chunk)
        now = time.perf_counter()
        while (end := pending.find(b"\n")) >= 0:
            line = pending[:end].decode().rstrip("\r")
            del pending[: end + 1]
            if line.startswith("data: "):
                stream.feed(line[6:], now)

    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await client.post_stream("/v1/chat/completions", chat_body(arrival, max_tokens, extra), on_chunk)
    except TimeoutError:
        out.code = "timeout"
        await client.close()  # the connection may be mid-answer: the next request opens another
        return out
    except (OSError, RuntimeError, ValueError, asyncio.IncompleteReadError) as e:
        out.status, out.code = "error", f"{type(e).__name__}: {e}"[:200]
        await client.close()
        return out
    return _classify(out, stream, started, time.perf_counter())


def _classify(out: Outcome, stream: _Stream, started: float, ended: float) -> Outcome:
    out.latency_ms = (ended - started) * 1000
    if stream.error is not None:
        out.status, out.code = "error", stream.error
        return out
    if not stream.finished:
        out.code = "no_finish"
        return out
    out.status = "completed"
    out.tokens = stream.tokens if stream.tokens is not None else stream.chunks
    if stream.first_token is not None:
        out.ttft_ms = (stream.first_token - started) * 1000
        if out.tokens > 1 and stream.last_token is not None:
            out.tpot_ms = (stream.last_token - stream.first_token) * 1000 / (out.tokens - 1)
    return out


async def run_open_loop(
    urls: list[str],
    keys: dict[str, str],
    arrivals: list[Arrival],
    *,
    max_tokens: int,
    timeout_s: float,
    drain_s: float,
    transport: httpx.AsyncBaseTransport | None = None,
    extra: Callable[[Arrival], dict] | None = None,
) -> tuple[list[Outcome], float]:
    """Send every arrival at its scheduled time, whatever is still in flight; (outcomes, wall seconds).
    With several gateway ``urls`` the arrivals go to each in turn (what a round-robin balancer does);
    ``extra`` gives each arrival a peer server's own body fields (``send``'s).

    After the last arrival, in-flight requests get ``drain_s`` more; any still running then is lost."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with contextlib.AsyncExitStack() as clients:
        gateways = [
            await clients.enter_async_context(
                httpx.AsyncClient(
                    base_url=url, timeout=httpx.Timeout(timeout_s + 5), limits=limits, transport=transport
                )
            )
            for url in urls
        ]
        tasks: dict[asyncio.Task, Arrival] = {}
        start = time.perf_counter()
        for arrival in arrivals:
            delay = start + arrival.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lag_ms = max(0.0, (time.perf_counter() - start - arrival.at_s) * 1000)
            client = gateways[len(tasks) % len(gateways)]
            fields = extra(arrival) if extra else None
            task = asyncio.create_task(
                send(
                    client,
                    keys[arrival.tenant],
                    arrival,
                    max_tokens=max_tokens,
                    timeout_s=timeout_s,
                    lag_ms=lag_ms,
                    extra=fields,
                )
            )
            tasks[task] = arrival
        if tasks:
            await asyncio.wait(tasks, timeout=drain_s)
        wall_s = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    outcomes = []
    for task, arrival in tasks.items():
        if task.cancelled():
            outcomes.append(
                Outcome(arrival.index, arrival.tenant, arrival.model, "lost", "unfinished_at_drain", arrival.at_s, 0.0)
            )
        else:
            outcomes.append(task.result())
    return outcomes, wall_s
