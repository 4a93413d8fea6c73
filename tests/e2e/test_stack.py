"""End to end through the gateway with the official openai client, on the real SmolLM2 model."""

import asyncio
import contextlib
import socket
import sqlite3
import time

import httpx
import nats
import openai
import pytest

from shared import subjects
from shared.bus import decode, encode
from shared.schemas import InferRequest, ReplyEnvelope, ReplyFinal, ReplyToken, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(running_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)


def test_chat_answer_mentions_paris(client):
    reply = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=QUESTION, max_tokens=30, temperature=0
    )
    completion = reply.parse()
    assert "Paris" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.completion_tokens > 0
    assert reply.headers["x-lorafleet-request-id"]
    assert reply.headers["x-lorafleet-cache-hit"] in ("true", "false")


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_streamed_and_plain_greedy_answers_agree(client):
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    streamed = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.usage.completion_tokens == 12 or plain.choices[0].finish_reason == "stop"


def test_models_lists_the_base_model(client):
    assert MODEL in [m.id for m in client.models.list().data]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=QUESTION, max_tokens=5)


async def _direct_request(nats_url: str, tenant: str, **over) -> list:
    nc = await nats.connect(nats_url, inbox_prefix=f"_INBOX_{tenant}")  # a direct client's replies: its own inbox
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    fields = {
        "request_id": f"direct-{time.monotonic_ns()}",
        "tenant_id": tenant,
        "model": MODEL,
        "base_model": MODEL,
        "prompt": "The capital of France is",
        "sampling": SamplingParams(max_tokens=5, temperature=0),
        "reply_to": inbox,
    }
    fields.update(over)
    await nc.jetstream().publish(subjects.infer_submit(tenant), encode(InferRequest(**fields)))
    bodies = []
    while not bodies or bodies[-1].kind not in ("final", "error"):
        msg = await sub.next_msg(timeout=60)
        bodies.append(decode(ReplyEnvelope, msg.data).body)
    await nc.close()
    return bodies


def test_an_idle_connection_outlives_client_keep_alive_expiry(running_stack):
    """The gateway keeps idle connections longer than clients' pools do (httpx: 5 s). With uvicorn's
    default 5 s, a request sent as the server closed its side was reset mid-flight (the soak saw one)."""
    host, port = running_stack.gateway_url.removeprefix("http://").split(":")
    request = f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        for pause in (0.0, 6.5):
            time.sleep(pause)
            conn.sendall(request)
            head, body = _read_response(conn)
            assert head.startswith(b"HTTP/1.1 200"), head[:80]
            assert body == b'{"status":"ok"}'


def _read_response(conn: socket.socket) -> tuple[bytes, bytes]:
    """One whole HTTP/1.1 response (headers, then Content-Length bytes of body): the server may
    send them in separate writes, and a read must not leave the body for the next request."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"connection closed mid-response: {data[:80]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return head, body


def test_direct_nats_client_is_served(running_stack):
    bodies = asyncio.run(_direct_request(running_stack.nats.url, "demo"))
    assert bodies[0].kind == "accepted"
    assert any(isinstance(b, ReplyToken) for b in bodies)
    assert isinstance(bodies[-1], ReplyFinal) and bodies[-1].usage.completion_tokens == 5


def test_submitting_as_another_tenant_is_refused(running_stack):
    bodies = asyncio.run(_direct_request(running_stack.nats.url, "demo", tenant_id="other"))
    assert [b.kind for b in bodies] == ["error"]
    assert bodies[0].error.code == "forbidden"


async def _publish_garbage(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    for payload in (b"", b"{", b"[]", b'{"request_id": 5}', b"\x00" * 64, b'{"prompt": "x", "reply_to": "_INBOX.x"}'):
        await js.publish(subjects.infer_submit("demo"), payload)
        await nc.publish(subjects.WORKER_HEARTBEAT, payload)
        await nc.publish(subjects.service_heartbeat("worker"), payload)
    workers = set()
    sub = await nc.subscribe(subjects.WORKER_HEARTBEAT)
    while not workers:
        try:
            workers.add(decode_worker(await sub.next_msg(timeout=5)))
        except ValueError:
            continue
    for worker_id in workers:
        for payload in (b"", b"{}", b"not json", b'{"action": "cancel"}'):
            with contextlib.suppress(nats.errors.TimeoutError):
                await nc.request(subjects.worker_dispatch(worker_id), payload, timeout=2)
            await nc.publish(subjects.worker_control(worker_id), payload)
    await nc.close()


def decode_worker(msg) -> str:
    from shared.schemas import WorkerHeartbeat

    try:
        return decode(WorkerHeartbeat, msg.data).worker_id
    except Exception as e:
        raise ValueError(str(e)) from None


def test_malformed_nats_messages_crash_nothing(running_stack, client):
    asyncio.run(_publish_garbage(running_stack.nats.url))
    time.sleep(1)
    assert running_stack.stack.dead() == {}
    answer = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert answer.usage.completion_tokens == 5


def test_completions_are_audited(running_stack, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    deadline = time.monotonic() + 10
    rows = []
    while time.monotonic() < deadline and not rows:
        with sqlite3.connect(running_stack.db_path) as db:
            rows = db.execute("SELECT tenant_id, body FROM audit WHERE kind = 'completion'").fetchall()
        time.sleep(0.2)
    assert rows and all(tenant == "demo" for tenant, _ in rows)
    with sqlite3.connect(running_stack.db_path) as db:
        rejected = db.execute("SELECT COUNT(*) FROM audit WHERE kind = 'rejection'").fetchone()[0]
    assert rejected >= 1  # the cross-tenant submission above


def _readyz(url: str) -> tuple[int, dict]:
    r = httpx.get(f"{url}/readyz", timeout=5)
    return r.status_code, r.json()["components"]


def _wait_component(url: str, name: str, state: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, components = _readyz(url)
        if components[name] == state:
            return
        time.sleep(0.3)
    raise AssertionError(f"{name} never became {state!r}: {components}")


def test_killed_worker_gives_prompt_503_and_recovers(running_stack, client):
    running_stack.stack.kill("worker")
    _wait_component(running_stack.gateway_url, "workers", "missing")
    assert _readyz(running_stack.gateway_url)[0] == 503
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert info.value.status_code == 503
    assert time.monotonic() - start < 10
    assert running_stack.stack.dead() == {}
    running_stack.stack.start("worker")
    running_stack.ready(("worker",))
    _wait_component(running_stack.gateway_url, "workers", "1 ready")
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_killed_scheduler_gives_bounded_503(running_stack, client):
    running_stack.stack.kill("scheduler")
    _wait_component(running_stack.gateway_url, "scheduler", "missing")
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert info.value.status_code == 503
    assert time.monotonic() - start < 10
    running_stack.stack.start("scheduler")
    running_stack.ready(("scheduler",))
    _wait_component(running_stack.gateway_url, "scheduler", "ok")
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
