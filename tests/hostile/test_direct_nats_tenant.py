"""A direct-NATS tenant, past the gateway: every field it writes that the scheduler decides itself
(created_at, tenant, reply subject, request id, priority, adapter version and block) and every
oversize or malformed submission gets a typed refusal (on its own inbox where one can be read from
the body), changes no state (registry, work queue, quota counters, concurrency leases, dedupe
markers) and is audited as a scheduler RejectionAudit; a body that is no submission at all is
dropped, counted, and neither answered nor audited. Beside them, the regressions of what a
direct tenant could do before: hold no slot with a forged created_at, swallow another tenant's
request id (or be refused one another tenant has in flight), or be served the base model for an
adapter's name."""

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import nats.errors
import pytest
from nats.aio.client import Client as NATS
from redis.asyncio import Redis

from shared import subjects
from shared.bus import connect, decode
from shared.schemas import (
    AdapterRecordsReply,
    CreateTenantRequest,
    PromoteRequest,
    RegisterRequest,
    ReplyEnvelope,
    RollbackRequest,
    SetQuotaRequest,
    TenantQuota,
    TenantsReply,
)
from tests.helpers.bus import settled
from tests.hostile.conftest import MAX_BODY, MAX_MODEL_LEN, HostileStack, adapter_files, inline, registry_call
from tests.hostile.test_nats_hostile import adapter_of, collect, completions, infer, nothing_queued, submit

TENANT = "direct"
LONG_RUN = 6000  # tokens of a request a test keeps in flight: seconds on any machine (10 s here)
ADAPTER = "direct-chat"  # v1 production, v2 rolled back, v3 staging
PREFIX = "lf:"  # the stack's Redis key prefix (the default)
GATEWAY_INBOX = "_INBOX.gateway-inbox"  # where a gateway would read replies
SCHEDULER_STOPPED_S = 1.0  # under the stack's catalog.sync bound (LF_GATEWAY_SYNC_TIMEOUT_S)


@dataclass
class Direct:
    records: dict[int, dict]  # version -> the registry's record of direct-chat


async def _seed(hostile: HostileStack) -> Direct:
    nc = await connect(hostile.admin_url, "direct-seed")
    try:
        await registry_call(nc, "tenant_create", CreateTenantRequest(tenant_id=TENANT, actor="test"), TenantsReply)
        quota = TenantQuota(requests_per_min=100_000, max_concurrent=1)
        await registry_call(nc, "quota_set", SetQuotaRequest(tenant_id=TENANT, quota=quota, actor="test"), TenantsReply)
        for seed in (2, 3, 4):
            files = adapter_files(hostile.trusted_dir.parent / f"direct-{seed}", seed=seed)
            register = RegisterRequest(
                adapter_id=ADAPTER, tenant_id=TENANT, task_type="chat", inline_files=inline(files), actor="test"
            )
            version = (await registry_call(nc, "register", register, AdapterRecordsReply)).records[0].version
            if version < 3:
                promote = PromoteRequest(
                    adapter_id=ADAPTER,
                    version=version,
                    traffic_percent=100,
                    skip_eval=True,
                    reason="seed",
                    actor="test",
                )
                await registry_call(nc, "promote", promote, AdapterRecordsReply)
        await registry_call(nc, "rollback", RollbackRequest(adapter_id=ADAPTER, actor="test"), AdapterRecordsReply)
        listed = await hostile.snapshot(nc)
        versions = {r["version"]: r for r in listed["records"] if r["adapter_id"] == ADAPTER}
        assert {v: r["status"] for v, r in versions.items()} == {1: "production", 2: "retired", 3: "staging"}
        await _until_quota_applies(hostile, nc)
        return Direct(versions)
    finally:
        await nc.close()


async def _until_quota_applies(hostile: HostileStack, nc: NATS) -> None:
    """The scheduler mirrors quotas from KV: once a request of the tenant has written its
    requests-per-minute counter in Redis, the quota is the scheduler's."""
    redis = Redis.from_url(hostile.redis_url)
    try:
        deadline = time.monotonic() + 30
        while not await redis.exists(f"{PREFIX}quota:{TENANT}:rpm"):
            assert time.monotonic() < deadline, "the scheduler never applied the tenant's quota"
            rid = f"probe-{uuid.uuid4().hex[:8]}"
            sub = await nc.subscribe(f"_INBOX_{TENANT}.{rid}")
            await submit(nc, TENANT, infer(rid, tenant=TENANT))
            await collect(sub, 10)
            await sub.unsubscribe()
    finally:
        await redis.aclose()


@pytest.fixture(scope="module")
def direct(hostile: HostileStack) -> Iterator[Direct]:
    yield asyncio.run(_seed(hostile))


async def redis_state(hostile: HostileStack) -> dict:
    """The tenant's quota counters, concurrency leases and dedupe markers, as Redis holds them."""
    redis = Redis.from_url(hostile.redis_url, decode_responses=True)
    try:
        state = {}
        for pattern in (f"{PREFIX}quota:{TENANT}:*", f"{PREFIX}dispatched:{TENANT}:*"):
            async for key in redis.scan_iter(pattern):
                kind = await redis.type(key)
                if kind == "hash":
                    state[key] = await redis.hgetall(key)
                elif kind == "zset":
                    state[key] = await redis.zrange(key, 0, -1)
                else:
                    state[key] = await redis.get(key)
        return state
    finally:
        await redis.aclose()


async def state(hostile: HostileStack, nc: NATS) -> dict:
    return {**await hostile.snapshot(nc), "infer_last_seq": 0, "redis": await redis_state(hostile)}


async def assert_refused_without_trace(
    hostile: HostileStack, nc: NATS, payload: dict | bytes, inbox: str | None, code: str | None, audit_code: str
) -> None:
    """``payload`` submitted as the direct tenant: ``code`` on ``inbox`` (None: no reply can be
    addressed), nothing changed, nothing run, a scheduler rejection audited under ``audit_code``."""
    since = time.time()
    sub = await nc.subscribe(inbox or f"_INBOX_{TENANT}.nobody")
    spies = [await nc.subscribe("_INBOX_other.>"), await nc.subscribe(GATEWAY_INBOX)]
    before = await state(hostile, nc)
    await submit(nc, TENANT, payload)
    audit = await hostile.wait_audit("rejection", TENANT, since, service="scheduler", code=audit_code)
    if code is None:
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=0.5)
    else:
        bodies = await collect(sub, 5)
        assert [b.kind for b in bodies] == ["error"]
        assert (bodies[0].error.code, bodies[0].error.status < 500) == (code, True)
    await nothing_queued(nc)
    assert await state(hostile, nc) == before
    assert await completions(hostile, audit["request_id"], since) == []
    for spy in spies:
        with pytest.raises(nats.errors.TimeoutError):
            await spy.next_msg(timeout=0.2)


def valid(rid: str, **over: object) -> dict:
    return {**infer(rid, tenant=TENANT), **over}


def _forged_block(hostile: HostileStack, direct: Direct, demo_secret: dict, case: str) -> dict:
    def block(version: int, **over: object) -> dict:
        return adapter_of(hostile, direct.records[version], version=version, **over)

    return {
        "staging-under-released-name": {"model": ADAPTER, "adapter": block(3)},
        "forged-storage-uri": {"model": ADAPTER, "adapter": block(1, storage_uri="file:///etc/passwd")},
        "block-on-base-model": {"adapter": block(1)},
        "another-tenants-block": {"model": ADAPTER, "adapter": adapter_of(hostile, demo_secret)},
    }[case]


FORGED = [  # (edit of a valid submission, reply code, audit code)
    pytest.param({"tenant_id": "demo"}, "forbidden", "forbidden", id="forged-tenant"),
    pytest.param({"priority": "urgent"}, "invalid_message", "invalid_message", id="forged-priority"),
    pytest.param({"created_at": "yesterday"}, "invalid_message", "invalid_message", id="forged-created-at-type"),
    pytest.param({"request_id": "a b\r\nc"}, "invalid_message", "invalid_message", id="forged-request-id"),
    pytest.param({"tenant_gpu_slots": 0}, "invalid_message", "invalid_message", id="forged-gpu-slots"),
    pytest.param({"model": f"{ADAPTER}@3"}, "adapter_not_released", "adapter_not_released", id="pinned-staging"),
    pytest.param({"model": f"{ADAPTER}@2"}, "adapter_not_released", "adapter_not_released", id="pinned-rolled-back"),
    pytest.param({"model": f"{ADAPTER}@9"}, "model_not_found", "model_not_found", id="pinned-missing-version"),
    pytest.param({"model": f"{ADAPTER}@0"}, "model_not_found", "model_not_found", id="pinned-version-zero"),
    pytest.param({"model": "demo-secret"}, "model_not_found", "model_not_found", id="another-tenants-adapter"),
    pytest.param({"model": "demo-secret@1"}, "model_not_found", "model_not_found", id="another-tenants-version"),
    pytest.param("staging-under-released-name", "integrity_error", "integrity_error", id="block-staging-version"),
    pytest.param("forged-storage-uri", "integrity_error", "integrity_error", id="block-forged-storage-uri"),
    pytest.param("block-on-base-model", "integrity_error", "integrity_error", id="block-on-base-model"),
    pytest.param("another-tenants-block", "model_not_found", "tenant_isolation_attempt", id="block-of-another"),
    pytest.param({"base_model": "some-other-base", "model": ADAPTER}, "invalid_request", "invalid_request", id="base"),
]


@pytest.mark.parametrize("edit, code, audit_code", FORGED)
async def test_a_forged_field_is_refused_without_trace(
    hostile: HostileStack, direct: Direct, nc: NATS, edit, code, audit_code
):
    rid = f"forged-{uuid.uuid4().hex[:12]}"
    if isinstance(edit, str):
        records = {r["adapter_id"]: r for r in (await hostile.snapshot(nc))["records"]}
        edit = _forged_block(hostile, direct, records["demo-secret"], edit)
    inbox = f"_INBOX_{TENANT}.{rid}"
    await assert_refused_without_trace(hostile, nc, valid(rid, **edit), inbox, code, audit_code)


UNANSWERABLE = [  # (reply_to, audit code): no reply may go there, the refusal is audited
    pytest.param("_INBOX_other.x", "forbidden", id="reply-to-another-tenant"),
    pytest.param(GATEWAY_INBOX, "forbidden", id="reply-to-a-gateway-inbox"),
    pytest.param("_INBOX_direct.>", "invalid_message", id="reply-to-a-wildcard"),
    pytest.param("lf.worker.w1.dispatch", "invalid_message", id="reply-to-a-worker"),
]


@pytest.mark.parametrize("reply_to, audit_code", UNANSWERABLE)
async def test_a_forged_reply_subject_gets_no_reply_anywhere(
    hostile: HostileStack, direct: Direct, nc: NATS, reply_to, audit_code
):
    rid = f"reply-{uuid.uuid4().hex[:12]}"
    await assert_refused_without_trace(hostile, nc, valid(rid, reply_to=reply_to), None, None, audit_code)


OVERSIZE = [  # (edit, reply code): the gateway's bounds, applied by the scheduler
    pytest.param({"sampling": {"max_tokens": MAX_MODEL_LEN + 1}}, "invalid_request", id="max-tokens-over-the-limit"),
    pytest.param({"sampling": {"stop": ["a", "b", "c", "d", "e"]}}, "invalid_request", id="five-stop-strings"),
    pytest.param({"prompt": "hello " * 9000}, "invalid_request", id="prompt-over-8192-tokens"),
    pytest.param(
        {"prompt": None, "messages": [{"role": "user", "content": "hi " * 20}] * 1024}, "payload_too_large", id="body"
    ),
]


@pytest.mark.parametrize("edit, code", OVERSIZE)
async def test_an_oversize_submission_is_refused_with_the_gateways_bound(
    hostile: HostileStack, direct: Direct, nc: NATS, edit, code
):
    rid = f"big-{uuid.uuid4().hex[:12]}"
    payload = valid(rid, **edit)
    if code == "payload_too_large":
        assert len(json.dumps(payload)) > MAX_BODY
    await assert_refused_without_trace(hostile, nc, payload, f"_INBOX_{TENANT}.{rid}", code, code)


NOT_SUBMISSIONS = [  # bodies without what every publisher sets (a JSON object with request_id, tenant_id, reply_to)
    pytest.param(b"{", id="truncated-json"),
    pytest.param(b"\xff\xfe" * 64, id="not-utf8"),
    pytest.param(b"[]", id="json-array"),
    pytest.param(b'{"a": ' * 20_000 + b"1" + b"}" * 20_000, id="20000-deep"),
    pytest.param(b"", id="empty"),
    pytest.param(b'{"stream": "INFER", "seq": 7}', id="a-jetstream-acknowledgement"),
    pytest.param(json.dumps({"request_id": "m", "reply_to": f"_INBOX_{TENANT}.m"}).encode(), id="no-tenant"),
]


@pytest.mark.parametrize("payload", NOT_SUBMISSIONS)
async def test_a_body_that_is_no_submission_is_dropped_unanswered_and_unaudited(
    hostile: HostileStack, direct: Direct, nc: NATS, payload
):
    """Before issue 47 each was audited under the subject's tenant, who may never have sent it (a
    flood of redirected acknowledgements wrote 6,013 rejection records under its victim)."""
    since = time.time()
    spies = [await nc.subscribe(f"_INBOX_{TENANT}.>"), await nc.subscribe("_INBOX_other.>")]
    before = await state(hostile, nc)
    dropped = hostile.scrape("scheduler", "undecodable_messages_total", source=subjects.INFER_STREAM)
    await submit(nc, TENANT, payload)
    deadline = time.monotonic() + 10
    while hostile.scrape("scheduler", "undecodable_messages_total", source=subjects.INFER_STREAM) < dropped + 1:
        assert time.monotonic() < deadline, "the scheduler never dropped the body"
        await asyncio.sleep(0.05)
    await nothing_queued(nc)
    assert await state(hostile, nc) == before
    assert hostile.audits("rejection", TENANT, since) == []
    await settled(nc)
    assert [spy.pending_msgs for spy in spies] == [0, 0]


async def test_a_typed_but_invalid_submission_is_answered_on_its_inbox_and_audited(
    hostile: HostileStack, direct: Direct, nc: NATS
):
    payload = json.dumps({"request_id": 5, "tenant_id": TENANT, "reply_to": f"_INBOX_{TENANT}.m"}).encode()
    await assert_refused_without_trace(hostile, nc, payload, f"_INBOX_{TENANT}.m", "invalid_message", "invalid_message")


async def test_a_forged_created_at_frees_no_slot_while_the_request_runs(hostile: HostileStack, direct: Direct, nc):
    """max_concurrent=1: a request submitted with created_at=0 holds the tenant's one slot until it
    ends (before: the inflight sweep freed it on the next tick, 20 of 20 such requests admitted)."""
    rid = f"epoch-{uuid.uuid4().hex[:12]}"
    sub = await nc.subscribe(f"_INBOX_{TENANT}.{rid}")
    # it outlasts the probes (a second of sleep, then three refusals) on any machine
    long_run = valid(rid, created_at=0, sampling={"max_tokens": LONG_RUN, "ignore_eos": True, "temperature": 0})
    await submit(nc, TENANT, long_run)
    assert (await sub.next_msg(timeout=10)).data  # accepted: it runs
    await asyncio.sleep(1.0)  # four sweep ticks
    refused = []
    for i in range(3):
        probe = f"{rid}-{i}"
        psub = await nc.subscribe(f"_INBOX_{TENANT}.{probe}")
        await submit(nc, TENANT, valid(probe, created_at=0))
        refused += [b.error.code for b in await collect(psub, 5) if b.kind == "error"]
    assert refused == ["quota_exceeded"] * 3
    bodies = await collect(sub, 120)
    assert bodies[-1].kind == "final" and bodies[-1].usage.completion_tokens == LONG_RUN


async def test_an_adapters_name_without_a_block_is_served_by_that_adapter(hostile: HostileStack, direct: Direct, nc):
    """Before: only base_model was checked, and the base model answered silently."""
    rid = f"named-{uuid.uuid4().hex[:12]}"
    sub = await nc.subscribe(f"_INBOX_{TENANT}.{rid}")
    await submit(nc, TENANT, valid(rid, model=ADAPTER))
    bodies = await collect(sub, 30)
    assert bodies[-1].kind == "final", bodies
    served = bodies[-1].served_by
    assert (served.adapter_id, served.adapter_version) == (ADAPTER, 1)
    assert served.adapter_digest == direct.records[1]["checksum"]


async def test_another_tenants_request_id_does_not_swallow_this_tenants_request(
    hostile: HostileStack, direct: Direct, nc
):
    """Before: one request-id namespace, so ``other`` submitting an id first made this tenant's
    request under it be acknowledged and dropped, never answered."""
    rid, since = f"shared-id-{uuid.uuid4().hex[:12]}", time.time()
    for tenant in ("other", TENANT):
        sub = await nc.subscribe(f"_INBOX_{tenant}.{rid}")
        await submit(nc, tenant, infer(rid, tenant=tenant))
        bodies = await collect(sub, 30)
        assert (bodies[0].kind, bodies[-1].kind) == ("accepted", "final"), (tenant, bodies)
    await hostile.wait_audit("completion", TENANT, since, request_id=rid)
    served = sorted(a["tenant_id"] for a in await completions(hostile, rid, since))
    assert served == sorted(["other", TENANT])


async def test_a_tenant_reusing_another_tenants_in_flight_id_is_served_with_its_own_adapter(
    hostile: HostileStack, direct: Direct, nc
):
    """Before: the scheduler's in-flight maps were keyed by request id alone, so this tenant's
    request under an id another tenant had in flight was refused (409 request_id_in_use)."""
    rid, since = f"both-{uuid.uuid4().hex[:12]}", time.time()
    seen: list[tuple[str, str]] = []  # (tenant, reply kind), in arrival order
    bodies: dict[str, list] = {"other": [], TENANT: []}

    def listener(tenant: str):
        async def on_reply(msg) -> None:
            body = decode(ReplyEnvelope, msg.data).body
            seen.append((tenant, body.kind))
            bodies[tenant].append(body)

        return on_reply

    for tenant in bodies:
        await nc.subscribe(f"_INBOX_{tenant}.{rid}", cb=listener(tenant))
    long_run = {"max_tokens": LONG_RUN // 2, "ignore_eos": True, "temperature": 0}
    await submit(nc, "other", infer(rid, tenant="other", model=hostile.adapters["other"], sampling=long_run))
    await _until(lambda: ("other", "token") in seen, "the other tenant's request never ran")
    await submit(nc, TENANT, valid(rid, model=ADAPTER))
    await _until(lambda: all(b and b[-1].kind in ("final", "error") for b in bodies.values()), "a request never ended")
    assert seen.index((TENANT, "accepted")) < seen.index(("other", "final"))  # both in flight at once
    mine, theirs = bodies[TENANT][-1], bodies["other"][-1]
    assert (mine.kind, theirs.kind) == ("final", "final"), (mine, theirs)
    assert (mine.served_by.adapter_id, mine.served_by.adapter_digest) == (ADAPTER, direct.records[1]["checksum"])
    assert theirs.served_by.adapter_id == hostile.adapters["other"] and theirs.usage.completion_tokens == LONG_RUN // 2
    await hostile.wait_audit("completion", TENANT, since, request_id=rid)
    await hostile.wait_audit("completion", "other", since, request_id=rid)
    served = sorted((a["tenant_id"], a["adapter_id"]) for a in await completions(hostile, rid, since))
    assert served == [(TENANT, ADAPTER), ("other", hostile.adapters["other"])]
    assert hostile.audits("rejection", TENANT, since) == []


async def _until(done, message: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(0.05)


async def test_a_rollback_returns_once_the_scheduler_resolves_with_it(hostile: HostileStack, direct: Direct, nc):
    """A direct submission right after a rollback is served the version rolled back to. The
    scheduler is held stopped while the rollback runs: the registry's catalog.sync barrier waits for
    its mirror (before: it waited for the gateways only and returned at once, the scheduler's mirror,
    which resolves direct submissions, possibly still holding the version rolled back)."""
    adapter = "direct-roll"
    digests = {}
    for seed in (5, 6):
        files = adapter_files(hostile.trusted_dir.parent / f"roll-{seed}", seed=seed)
        register = RegisterRequest(
            adapter_id=adapter, tenant_id=TENANT, task_type="chat", inline_files=inline(files), actor="test"
        )
        record = (await registry_call(nc, "register", register, AdapterRecordsReply)).records[0]
        digests[record.version] = record.digest
        promote = PromoteRequest(
            adapter_id=adapter, version=record.version, traffic_percent=100, skip_eval=True, reason="roll", actor="test"
        )
        await registry_call(nc, "promote", promote, AdapterRecordsReply)
    scheduler = hostile.stack.procs["scheduler"]
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        rollback = asyncio.create_task(
            registry_call(nc, "rollback", RollbackRequest(adapter_id=adapter, actor="test"), AdapterRecordsReply)
        )
        await asyncio.sleep(SCHEDULER_STOPPED_S)
        assert not rollback.done(), "the rollback returned before the scheduler's mirror held it"
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)
    await rollback
    rid = f"rolled-{uuid.uuid4().hex[:12]}"
    sub = await nc.subscribe(f"_INBOX_{TENANT}.{rid}")
    await submit(nc, TENANT, valid(rid, model=adapter))
    bodies = await collect(sub, 30)
    assert bodies[-1].kind == "final", bodies
    served = bodies[-1].served_by
    assert (served.adapter_id, served.adapter_version, served.adapter_digest) == (adapter, 1, digests[1])
