"""Feedback (``POST /v1/feedback``) as a hostile client posts it (issue 47): the same rating posted
over and over is recorded once, each post is charged to the tenant's request quota, and a rating of
another tenant's request is the 404 of a request that never existed and records nothing."""

import asyncio
import time
import uuid

from nats.aio.client import Client as NATS

from shared import subjects
from shared.schemas import (
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    SetQuotaRequest,
    TenantQuota,
    TenantsReply,
)
from tests.hostile.conftest import MODEL, HostileStack, registry_call


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


async def test_feedback_is_charged_to_the_tenants_request_quota(hostile: HostileStack, nc: NATS):
    """Before issue 47 a tenant at requests_per_min=5 posted 500 ratings in 0.7 s."""
    tenant = f"fbq{uuid.uuid4().hex[:6]}"
    await registry_call(nc, "tenant_create", CreateTenantRequest(tenant_id=tenant, actor="test"), TenantsReply)
    created = CreateApiKeyRequest(tenant_id=tenant, scopes=["inference"], actor="test")
    key = (await registry_call(nc, "api_key_create", created, ApiKeyCreatedReply)).key
    quota = SetQuotaRequest(tenant_id=tenant, quota=TenantQuota(requests_per_min=3), actor="test")
    await registry_call(nc, "quota_set", quota, TenantsReply)
    async with hostile.client(key) as client:
        deadline = time.monotonic() + 20
        while True:  # the gateway's key mirror, then the completion
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            if r.status_code == 200:
                break
            assert time.monotonic() < deadline, r.text
            await asyncio.sleep(0.1)
        request_id = r.headers["x-lorafleet-request-id"]
        deadline, posted = time.monotonic() + 20, 0
        while True:  # refused once the scheduler applies the quota it mirrors (moments after the set)
            r = await client.post("/v1/feedback", json={"request_id": request_id, "rating": "down"})
            posted += 1
            if r.status_code == 429:
                break
            assert r.status_code == 200 and time.monotonic() < deadline, (posted, r.text)
    assert r.json()["error"]["code"] == "quota_exceeded" and float(r.headers["retry-after"]) > 0
