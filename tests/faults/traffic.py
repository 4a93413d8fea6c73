"""Client traffic through the gateway, each call reduced to one checked Outcome: served whole
exactly once, or refused with a typed error, and never past its time bound."""

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import httpx

from tests.faults.conftest import ADAPTER, REQUEST_TIMEOUT_S
from tests.scheduler.conftest import MODEL

BOUND_S = REQUEST_TIMEOUT_S + 15  # the gateway's own bound plus slack: past this a request "hangs"
PROMPT = "Tell me about the sea."
# What a client may see instead of an answer while a fault lasts: each is a typed, documented refusal.
# "overloaded" (429 with Retry-After): the scheduler's SLO shedding refusing at once while a failover
# stalls the fleet's estimate (seen once in CI when a NATS node was killed under load).
TRANSIENT = {"service_unavailable", "no_worker_available", "worker_lost", "upstream_timeout", "overloaded"}
MIX = [("key-demo", MODEL), ("key-other", MODEL), ("key-demo", ADAPTER)]  # two tenants, base and adapter


@dataclass(slots=True)
class Outcome:
    status: int
    model: str
    stream: bool
    elapsed_s: float
    code: str | None = None  # the typed error code, when refused
    message: str = ""  # the refusal's message
    request_id: str = ""
    text: str = ""
    finishes: list[str] = field(default_factory=list)  # finish_reason of every finishing chunk
    done_markers: int = 0  # "data: [DONE]" lines
    completion_tokens: int | None = None
    started_s: float = 0.0  # time.monotonic() when the request was sent
    ttft_s: float | None = None  # to the first content (streamed) or to the whole answer (plain)

    @property
    def served(self) -> bool:
        """A whole answer: one finish, and for a stream one [DONE] and its usage."""
        if self.status != 200 or self.code is not None or len(self.finishes) != 1:
            return False
        if self.finishes[0] not in ("stop", "length"):
            return False
        return not self.stream or (self.done_markers == 1 and self.completion_tokens is not None)

    def whole(self, max_tokens: int) -> bool:
        """Served, with every token asked for (requests here set ignore_eos)."""
        return self.served and self.completion_tokens == max_tokens and self.finishes == ["length"]

    def describe(self) -> str:
        return (
            f"status={self.status} code={self.code} stream={self.stream} finishes={self.finishes} "
            f"done={self.done_markers} tokens={self.completion_tokens} {self.elapsed_s:.1f}s id={self.request_id}"
            + (f" message={self.message!r}" if self.message else "")
        )


def _body(model: str, max_tokens: int, stream: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _refused(response: httpx.Response, out: Outcome) -> None:
    try:
        error = response.json()["error"]
        out.code, out.message = error["code"], str(error.get("message", ""))
    except (ValueError, KeyError, TypeError):
        out.code = f"untyped:{response.text[:200]}"


async def _plain(client: httpx.AsyncClient, key: str, body: dict, out: Outcome) -> None:
    response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
    out.status = response.status_code
    out.request_id = response.headers.get("x-lorafleet-request-id", "")
    if response.status_code != 200:
        _refused(response, out)
        return
    answer = response.json()
    out.text = answer["choices"][0]["message"]["content"]
    out.finishes = [answer["choices"][0]["finish_reason"]]
    out.completion_tokens = answer["usage"]["completion_tokens"]
    out.ttft_s = time.monotonic() - out.started_s


async def _streamed(client: httpx.AsyncClient, key: str, body: dict, out: Outcome) -> None:
    async with client.stream(
        "POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, json=body
    ) as response:
        out.status = response.status_code
        out.request_id = response.headers.get("x-lorafleet-request-id", "")
        if response.status_code != 200:
            await response.aread()
            _refused(response, out)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out.done_markers += 1
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.code, out.message = chunk["error"]["code"], str(chunk["error"].get("message", ""))
                continue
            if chunk.get("usage"):
                out.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if choice["delta"].get("content") and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - out.started_s
                out.text += choice["delta"].get("content") or ""
                if choice["finish_reason"]:
                    out.finishes.append(choice["finish_reason"])


async def chat(
    client: httpx.AsyncClient, key: str, model: str = MODEL, *, max_tokens: int = 16, stream: bool = False
) -> Outcome:
    """One chat completion, plain or streamed, with the transport's failures recorded, not raised."""
    out = Outcome(status=0, model=model, stream=stream, elapsed_s=0.0)
    start = out.started_s = time.monotonic()
    try:
        await asyncio.wait_for(
            (_streamed if stream else _plain)(client, key, _body(model, max_tokens, stream), out), BOUND_S
        )
    except TimeoutError:
        out.code = "client_timeout"
    except httpx.HTTPError as e:
        out.code = f"transport:{type(e).__name__}"
    out.elapsed_s = time.monotonic() - start
    return out


def gateway(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=BOUND_S, limits=httpx.Limits(max_connections=200))


def check_served_or_refused(outcomes: list[Outcome], allowed: set[str] = TRANSIENT) -> None:
    """Every request ended within its bound, either served whole or refused with an allowed typed code."""
    for out in outcomes:
        assert out.elapsed_s < BOUND_S, out.describe()
        assert out.served or out.code in allowed, out.describe()
        if out.stream and out.code is not None:  # a refused stream still ends cleanly, once
            assert out.done_markers <= 1 and not out.finishes, out.describe()


async def steady(client: httpx.AsyncClient, n: int, interval_s: float, max_tokens: int) -> list[Outcome]:
    """``n`` requests of the MIX, plain and streamed in turn, one every ``interval_s``."""
    calls = []
    for i, (key, model) in zip(range(n), itertools.cycle(MIX)):
        calls.append(asyncio.create_task(chat(client, key, model, max_tokens=max_tokens, stream=i % 2 == 0)))
        await asyncio.sleep(interval_s)
    return list(await asyncio.gather(*calls))
