"""Hostile NATS messages published straight onto the bus, past the gateway: the registry answers
each with a typed error in the Lf-Error header, the scheduler answers a direct tenant's bad
submission with a typed ReplyError on its own inbox and audits it, and nothing runs twice,
crosses tenants or changes state."""

import asyncio
import json
import sqlite3
import time
import uuid

import httpx
import nats.errors
import pytest
from nats.aio.client import Client as NATS

from shared import subjects
from shared.bus import ERROR_HEADER, decode, encode
from shared.schemas import ErrorBody, InferRequest, ReplyEnvelope, ResolvedAdapter, SamplingParams, WorkerHeartbeat
from tests.helpers.bus import settled
from tests.hostile.conftest import MODEL, WORKER, HostileStack

DEMO_SECRET = '{"tenant_id": "demo", "adapter_id": "demo-secret", "version": 1, "actor": "x"}'


def deep(depth: int) -> bytes:
    return b'{"adapter_id": ' + b"[" * depth + b"]" * depth + b"}"


REGISTRY = [  # (op, payload, typed error code)
    pytest.param("resolve", b"{", "invalid_message", id="resolve-truncated-json"),
    pytest.param(
        "register",
        json.dumps(
            {"adapter_id": "../../etc/passwd", "tenant_id": "demo", "task_type": "t", "inline_files": {}, "actor": "x"}
        ).encode(),
        "invalid_message",
        id="register-traversal-id",
    ),
    pytest.param(
        "register",
        json.dumps(
            {
                "adapter_id": "demo-secret",
                "tenant_id": "demo",
                "task_type": "t",
                "inline_files": {},
                "actor": "x",
                "status": "production",
            }
        ).encode(),
        "invalid_message",
        id="register-injected-status",
    ),
    pytest.param("tenant_create", b'{"tenant_id": "a.>", "actor": "x"}', "invalid_message", id="tenant-wildcard-id"),
    pytest.param(
        "tenant_create", b'{"tenant_id": "shared", "actor": "x"}', "invalid_request", id="tenant-reserved-name"
    ),
    pytest.param(
        "api_key_create",
        b'{"tenant_id": "demo", "scopes": ["root"], "actor": "x"}',
        "invalid_message",
        id="key-unknown-scope",
    ),
    pytest.param(
        "quota_set",
        b'{"tenant_id": "demo", "quota": {"requests_per_min": -5}, "actor": "x"}',
        "invalid_message",
        id="quota-negative",
    ),
    pytest.param(
        "trust_key",
        b'{"signer": "evil", "public_key": "AAAA", "actor": "x"}',
        "invalid_message",
        id="trust-garbage-key",
    ),
    pytest.param(
        "record_eval",
        DEMO_SECRET.replace('"version": 1', '"version": 1, "results": {"score": NaN}')
        .replace('"tenant_id": "demo", ', "")
        .encode(),
        "invalid_message",
        id="eval-NaN-score",
    ),
    pytest.param("promote", deep(20_000), "invalid_message", id="promote-20000-deep"),
    pytest.param("revoke", b"\x00" * 4096, "invalid_message", id="revoke-nul-bytes"),
    pytest.param("api_key_revoke", b"[" * 1_000_000, "invalid_message", id="key-revoke-1MB-of-brackets"),
]


@pytest.mark.parametrize("op, payload, code", REGISTRY)
async def test_registry_answers_garbage_with_a_typed_error(hostile: HostileStack, nc: NATS, op, payload, code):
    before = await hostile.snapshot(nc)
    reply = await nc.request(subjects.registry(op), payload, timeout=10)
    assert reply.headers and reply.headers[ERROR_HEADER] == code
    body = decode(ErrorBody, reply.data)
    assert (body.code, body.status) == (code, 400) and body.message
    assert await hostile.snapshot(nc) == before


async def test_message_over_the_max_payload_never_leaves_the_client(hostile: HostileStack, nc: NATS):
    before = await hostile.snapshot(nc)
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.publish(subjects.infer_submit("demo"), b"x" * (nc.max_payload + 1))
    with pytest.raises(nats.errors.MaxPayloadError):
        await nc.request(subjects.registry("register"), b"{" * (nc.max_payload + 1), timeout=5)
    assert await hostile.snapshot(nc) == before
    await hostile.assert_alive()


def infer(rid: str, tenant: str = "demo", inbox: str | None = None, **over: object) -> dict:
    request = InferRequest(
        request_id=rid,
        tenant_id=tenant,
        model=MODEL,
        base_model=MODEL,
        prompt="Hello",
        sampling=SamplingParams(max_tokens=2, temperature=0),
        reply_to=inbox or f"_INBOX_{tenant}.{rid}",
    )
    return {**json.loads(request.model_dump_json()), **over}


async def collect(sub, timeout_s: float) -> list:
    """Reply bodies until a final or an error, or until ``timeout_s`` of silence."""
    bodies = []
    while not bodies or bodies[-1].kind not in ("final", "error"):
        try:
            msg = await sub.next_msg(timeout=timeout_s)
        except nats.errors.TimeoutError:
            break
        bodies.append(decode(ReplyEnvelope, msg.data).body)
    return bodies


async def submit(nc: NATS, tenant: str, payload: dict | bytes, msg_id: str | None = None):
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    return await nc.jetstream().publish(subjects.infer_submit(tenant), data, headers=headers)


def adapter_of(hostile: HostileStack, record: dict, **over: object) -> dict:
    granted = ResolvedAdapter(
        adapter_id=record["adapter_id"],
        version=1,
        rank=record["rank"],
        digest=record["checksum"],
        storage_uri=record["storage_uri"],
        alpha=record["alpha"],
        target_modules=record["target_modules"],
    )
    return {**json.loads(granted.model_dump_json()), **over}


async def completions(hostile: HostileStack, rid: str, since: float) -> list[dict]:
    await asyncio.sleep(0.5)  # the worker audits a completion right after its final reply
    return [
        a
        for tenant in ("demo", "other", "direct")
        for a in hostile.audits("completion", tenant, since)
        if a["request_id"] == rid
    ]


SUBMISSIONS = [  # (edit of a valid demo submission, typed code, audit code)
    pytest.param({"sampling": {"max_tokens": 10**9}}, "invalid_message", "invalid_message", id="max-tokens-1e9"),
    pytest.param({"worker_id": WORKER}, "invalid_message", "invalid_message", id="injected-worker-id"),
    pytest.param({"prompt": "a\ud800b"}, "invalid_message", "invalid_message", id="lone-surrogate"),
    pytest.param({"request_id": "../../x y"}, "invalid_message", "invalid_message", id="traversal-request-id"),
    pytest.param({"tenant_id": "other"}, "forbidden", "forbidden", id="tenant-id-of-another"),
    pytest.param({"adapter": "other"}, "model_not_found", "tenant_isolation_attempt", id="foreign-adapter"),
    pytest.param({"adapter": "missing"}, "model_not_found", "model_not_found", id="unknown-adapter"),
    pytest.param({"adapter": "forged-rank"}, "integrity_error", "integrity_error", id="own-adapter-forged-rank"),
    pytest.param({"adapter": "forged-digest"}, "integrity_error", "integrity_error", id="own-adapter-forged-digest"),
]


async def nothing_queued(nc: NATS, timeout_s: float = 5) -> None:
    """The refused submission leaves the work queue: the scheduler terminates it right after replying,
    so under load the stream may still hold it for a moment when the reply arrives."""
    deadline = time.monotonic() + timeout_s
    while (await nc.jetstream().stream_info(subjects.INFER_STREAM)).state.messages:
        assert time.monotonic() < deadline, "the refused submission is still queued"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("edit, code, audit_code", SUBMISSIONS)
async def test_direct_submission_is_refused_on_the_tenants_own_inbox(
    hostile: HostileStack, nc: NATS, edit, code, audit_code
):
    rid, since = f"hostile-{uuid.uuid4().hex[:12]}", time.time()
    records = {r["adapter_id"]: r for r in (await hostile.snapshot(nc))["records"]}
    adapters = {
        "other": adapter_of(hostile, records["other-secret"]),
        "missing": adapter_of(hostile, records["demo-secret"], adapter_id="nothing-here"),
        "forged-rank": adapter_of(hostile, records["demo-secret"], rank=1),
        "forged-digest": adapter_of(hostile, records["demo-secret"], digest="0" * 64),
    }
    if "adapter" in edit:
        # a forged block under its adapter's own name: the scheduler resolves the name, then compares
        named = "demo-secret" if edit["adapter"].startswith("forged") else "any-name"
        edit = {"adapter": adapters[edit["adapter"]], "model": named}
    inbox = f"_INBOX_demo.{rid}"
    sub = await nc.subscribe(inbox)
    spy = await nc.subscribe("_INBOX_other.>")
    before = await hostile.snapshot(nc)
    await submit(nc, "demo", {**infer(rid, inbox=inbox), **edit})
    bodies = await collect(sub, 5)
    assert [b.kind for b in bodies] == ["error"]
    assert (bodies[0].error.code, bodies[0].error.status < 500) == (code, True)
    after = await hostile.snapshot(nc)
    assert {**after, "infer_last_seq": 0} == {**before, "infer_last_seq": 0}  # only the stream's counter moved
    await nothing_queued(nc)
    await hostile.wait_audit("rejection", "demo", since, service="scheduler", code=audit_code)
    assert await completions(hostile, bodies[0].request_id, since) == []  # the worker ran nothing
    with pytest.raises(nats.errors.TimeoutError):
        await spy.next_msg(timeout=0.2)


async def test_the_registrys_own_grant_is_still_served(hostile: HostileStack, nc: NATS):
    """The control of the adapter cases above: the same adapter, exactly as the registry records it."""
    rid = f"granted-{uuid.uuid4().hex[:12]}"
    record = next(r for r in (await hostile.snapshot(nc))["records"] if r["adapter_id"] == "demo-secret")
    sub = await nc.subscribe(f"_INBOX_demo.{rid}")
    await submit(nc, "demo", {**infer(rid), "model": "demo-secret", "adapter": adapter_of(hostile, record)})
    bodies = await collect(sub, 10)
    assert (bodies[0].kind, bodies[-1].kind) == ("accepted", "final")
    assert bodies[-1].served_by.adapter_id == "demo-secret"
    async with hostile.client(hostile.keys.demo) as c:
        r = await c.post("/v1/completions", json={"model": "demo-secret", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-lorafleet-adapter"] == "demo-secret"


async def test_reply_to_another_tenants_inbox_is_refused_silently(hostile: HostileStack, nc: NATS):
    rid, since = f"hostile-{uuid.uuid4().hex[:12]}", time.time()
    spy = await nc.subscribe("_INBOX_other.>")
    await submit(nc, "demo", infer(rid, inbox=f"_INBOX_other.{rid}"))
    audit = await hostile.wait_audit("rejection", "demo", since, service="scheduler", code="forbidden")
    assert "inbox" in audit["reason"]
    with pytest.raises(nats.errors.TimeoutError):
        await spy.next_msg(timeout=1)
    assert await completions(hostile, rid, since) == []


async def test_replay_with_the_same_msg_id_is_deduplicated(hostile: HostileStack, nc: NATS):
    rid, since = f"replay-{uuid.uuid4().hex[:12]}", time.time()
    sub = await nc.subscribe(f"_INBOX_demo.{rid}")
    first = await submit(nc, "demo", infer(rid), msg_id=rid)
    replayed = await submit(nc, "demo", infer(rid), msg_id=rid)
    assert (bool(first.duplicate), replayed.duplicate, replayed.seq) == (False, True, first.seq)
    bodies = await collect(sub, 5)
    assert (bodies[0].kind, bodies[-1].kind) == ("accepted", "final")
    assert await collect(sub, 1) == []  # nothing more: served once
    late = await submit(nc, "demo", infer(rid), msg_id=f"{rid}-again")  # past the stream's dedupe: the scheduler's
    assert not late.duplicate
    refused = await collect(sub, 5)  # a new submission under an id already served: 409, never a rerun
    assert [b.kind for b in refused] == ["error"] and refused[0].error.code == "request_id_in_use"
    assert refused[0].error.status == 409
    await nothing_queued(nc)
    assert len(await completions(hostile, rid, since)) == 1


async def test_another_tenants_request_id_is_served_and_a_cancel_stops_only_its_owners(hostile: HostileStack, nc: NATS):
    """``other`` submits, straight to NATS, the id of a request demo has running through the gateway;
    then demo's client leaves, and the gateway cancels demo's request. Before: the in-flight maps were
    keyed by request id alone, so other's request was refused (409) while demo's ran."""
    since = time.time()
    async with hostile.client(hostile.keys.demo) as c:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            rid = r.headers["x-lorafleet-request-id"]
            lines = r.aiter_lines()
            first = [await anext(lines) for _ in range(6)]
            sub = await nc.subscribe(f"_INBOX_other.{rid}")
            sampling = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
            await submit(nc, "other", infer(rid, tenant="other", sampling=sampling), msg_id=f"other-{rid}")
            started = [decode(ReplyEnvelope, (await sub.next_msg(timeout=30)).data).body for _ in range(2)]
            assert [b.kind for b in started] == ["accepted", "token"], started
            more = [await anext(lines) for _ in range(6)]
        # demo's client is gone: the gateway cancels (demo, rid) on the worker
    assert all(line.startswith("data: {") or not line for line in first + more)
    assert all('"error"' not in line for line in first + more)
    bodies = await collect(sub, 120)
    assert bodies[-1].kind == "final" and bodies[-1].finish_reason == "length", bodies[-1]
    assert bodies[-1].usage.completion_tokens == 2000
    cancelled = await hostile.wait_audit("completion", "demo", since, request_id=rid)
    finished = await hostile.wait_audit("completion", "other", since, request_id=rid)
    assert (cancelled["outcome"], finished["outcome"]) == ("cancelled", "length")
    with sqlite3.connect(hostile.db_path) as db:
        ended = db.execute(
            "SELECT tenant_id FROM audit WHERE kind = 'completion' AND request_id = ? ORDER BY pos", (rid,)
        ).fetchall()
    assert ended == [("demo",), ("other",)]  # demo's ended while other's, started before, still ran
    assert hostile.audits("rejection", "other", since) == []


async def test_forged_worker_heartbeats_divert_no_request(hostile: HostileStack, nc: NATS):
    ghost = WorkerHeartbeat(
        worker_id="ghost",
        base_model=MODEL,
        ready=True,
        running=0,
        waiting=0,
        max_running=512,
        kv_blocks_free=10**6,
        kv_blocks_total=10**6,
    )
    for payload in (encode(ghost), b"{}", b'{"worker_id": "w1", "ready": "yes"}', b"\xff" * 100):
        await nc.publish(subjects.WORKER_HEARTBEAT, payload)
    await settled(nc)
    async with hostile.client(hostile.keys.demo) as c:
        for _ in range(3):
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["x-lorafleet-worker"] == WORKER
    assert hostile.stack.dead() == {}


async def test_bus_is_still_served_after_every_hostile_message(hostile: HostileStack):
    await hostile.assert_alive()
    async with httpx.AsyncClient(base_url=hostile.gateway_url) as c:
        assert (await c.get("/readyz")).status_code == 200
