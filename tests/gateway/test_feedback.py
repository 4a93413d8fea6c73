"""POST /v1/feedback with a real auditor behind the gateway: a tenant rates its own completion and
the rating reaches the AUDIT stream naming the version that served it; another tenant's request id,
or one that never existed, is the same typed 404; a body naming a tenant or version is refused."""

import time
import uuid
from pathlib import Path

import pytest

from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import decode
from shared.schemas import AuditEnvelope, CompletionAudit, FeedbackAudit
from tests.gateway.adapters import make_adapter, release
from tests.gateway.conftest import BASE, Gateway, gateway_settings
from tests.gateway.fake_worker import WORKER_ID


async def served_completion(gateway: Gateway, key: str, tenant: str, model: str) -> str:
    """One completion through the gateway, audited as the worker audits it; its request id."""
    async with gateway.client(key) as http:
        reply = await http.post(
            "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]}
        )
    assert reply.status_code == 200, reply.text
    request_id = reply.headers["x-lorafleet-request-id"]
    [request] = [r for r in gateway.worker.requests if r.request_id == request_id]
    assert request.adapter is not None
    record = CompletionAudit(
        request_id=request_id,
        tenant_id=tenant,
        base_model=BASE,
        adapter_id=request.adapter.adapter_id,
        adapter_version=request.adapter.version,
        cache_hit=True,
        ttft_ms=1.0,
        tpot_ms=1.0,
        prompt_tokens=1,
        completion_tokens=2,
        worker_id=WORKER_ID,
        outcome="stop",
    )
    assert await publish_audit(gateway.nc.jetstream(), record, f"completion.{request_id}")  # type: ignore[attr-defined]
    return request_id


async def test_feedback_is_taken_for_own_requests_only(gateway: Gateway, auditor: None, tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:6]
    owner, owner_key = await gateway.tenant(f"fa{suffix}", scopes=("admin", "inference"))
    _, other_key = await gateway.tenant(f"fb{suffix}")
    adapter_id = f"fa{suffix}-sea"
    async with gateway.client(owner_key) as http:
        await release(http, make_adapter(tmp_path / adapter_id, seed=0), adapter_id)
    request_id = await served_completion(gateway, owner_key, owner, adapter_id)

    ratings = await gateway.nc.subscribe(subjects.audit("feedback", owner))  # type: ignore[attr-defined]
    async with gateway.client(owner_key) as http:
        taken = await http.post("/v1/feedback", json={"request_id": request_id, "rating": "down", "reason": "not JSON"})
    assert taken.status_code == 200, taken.text
    assert taken.json() == {
        "object": "feedback",
        "request_id": request_id,
        "rating": "down",
        "model": f"{adapter_id}@1",
    }
    event = decode(AuditEnvelope, (await ratings.next_msg(timeout=5)).data).body
    assert isinstance(event, FeedbackAudit)
    assert (event.tenant_id, event.adapter_id, event.adapter_version, event.rating, event.reason) == (
        owner,
        adapter_id,
        1,
        "down",
        "not JSON",
    )

    refusals = []
    async with gateway.client(other_key) as http:
        for rid in (request_id, f"never-{suffix}"):
            started = time.monotonic()
            answer = await http.post("/v1/feedback", json={"request_id": rid, "rating": "down"})
            refusals.append((answer.status_code, answer.json()["error"]["code"], time.monotonic() - started))
    assert [(s, c) for s, c, _ in refusals] == [(404, "request_not_found")] * 2
    lookup_s = gateway_settings("nats://unused").feedback_lookup_s
    assert all(took >= lookup_s for _, _, took in refusals)  # both wait out the lookup: no timing tells them apart
    with pytest.raises(TimeoutError):  # nothing was recorded for the foreign or the missing id
        await ratings.next_msg(timeout=0.5)

    async with gateway.client(owner_key) as http:
        smuggled = await http.post(
            "/v1/feedback", json={"request_id": request_id, "rating": "down", "tenant_id": "fb", "adapter_version": 2}
        )
        bad_rating = await http.post("/v1/feedback", json={"request_id": request_id, "rating": "meh"})
    assert (smuggled.status_code, bad_rating.status_code) == (400, 400)


async def test_the_same_rating_posted_again_and_again_is_recorded_once(
    gateway: Gateway, auditor: None, tmp_path: Path
) -> None:
    """Before issue 47: 500 posts on one request wrote 500 audit records (and each one weighed)."""
    suffix = uuid.uuid4().hex[:6]
    owner, key = await gateway.tenant(f"fr{suffix}", scopes=("admin", "inference"))
    adapter_id = f"fr{suffix}-sea"
    async with gateway.client(key) as http:
        await release(http, make_adapter(tmp_path / adapter_id, seed=0), adapter_id)
    request_id = await served_completion(gateway, key, owner, adapter_id)
    async with gateway.client(key) as http:
        for rating in ["down"] * 20 + ["up"]:  # then a changed mind, which is recorded
            answer = await http.post("/v1/feedback", json={"request_id": request_id, "rating": rating})
            assert answer.status_code == 200, answer.text
    subject = subjects.audit("feedback", owner)
    info = await gateway.nc.jetstream().stream_info(subjects.AUDIT_STREAM, subjects_filter=subject)  # type: ignore[attr-defined]
    assert (info.state.subjects or {}).get(subject) == 2
