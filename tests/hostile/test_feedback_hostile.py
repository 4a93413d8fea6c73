"""Feedback (``POST /v1/feedback``) as a hostile client posts it (issue 47): the same rating posted
over and over is recorded once, and a rating of another tenant's request is the 404 of a request that
never existed and records nothing."""

import uuid

from nats.aio.client import Client as NATS

from shared import subjects
from tests.hostile.conftest import HostileStack


async def feedback_records(nc: NATS, tenant: str) -> int:
    subject = subjects.audit("feedback", tenant)
    info = await nc.jetstream().stream_info(subjects.AUDIT_STREAM, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


async def served(hostile: HostileStack, key: str) -> str:
    async with hostile.client(key) as client:
        r = await client.post("/v1/completions", json={"model": "demo-secret", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    return r.headers["x-lorafleet-request-id"]


async def test_a_rating_posted_a_hundred_times_is_recorded_once(hostile: HostileStack, nc: NATS):
    request_id = await served(hostile, hostile.keys.demo)
    before = await feedback_records(nc, "demo")
    async with hostile.client(hostile.keys.demo) as client:
        for _ in range(100):
            r = await client.post("/v1/feedback", json={"request_id": request_id, "rating": "down"})
            assert r.status_code == 200, r.text
    assert await feedback_records(nc, "demo") - before == 1


async def test_a_rating_of_another_tenants_request_is_refused_and_records_nothing(hostile: HostileStack, nc: NATS):
    request_id = await served(hostile, hostile.keys.demo)
    before = {t: await feedback_records(nc, t) for t in ("demo", "other")}
    async with hostile.client(hostile.keys.other) as client:
        for rid in (request_id, f"never-{uuid.uuid4().hex[:8]}"):
            r = await client.post("/v1/feedback", json={"request_id": rid, "rating": "down"})
            assert (r.status_code, r.json()["error"]["code"]) == (404, "request_not_found")
    assert {t: await feedback_records(nc, t) for t in ("demo", "other")} == before
