"""The auditor resumes exactly where it stopped: no gaps, no duplicates, the chain intact."""

import asyncio
import time

import nats

from lorafleet.cli.stack import Stack
from services.auditor.store import AuditStore
from shared import subjects
from shared.bus import encode, ensure_streams
from shared.schemas import AuditEnvelope, CompletionAudit


def completion(i: int) -> AuditEnvelope:
    return AuditEnvelope(
        body=CompletionAudit(
            request_id=f"req-{i}",
            tenant_id="acme",
            base_model="m",
            cache_hit=True,
            ttft_ms=1,
            tpot_ms=1,
            prompt_tokens=1,
            completion_tokens=1,
            worker_id="w1",
            outcome="stop",
        )
    )


async def publish(url: str, start: int, stop: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js)
    for i in range(start, stop):
        await js.publish(subjects.audit("completion", "acme"), encode(completion(i)))
    await nc.close()


def wait_count(db, at_least: int, timeout_s: float = 120) -> int:  # generous: a loaded machine is slow, never wrong
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if db.exists():
            store = AuditStore(db)
            count = store.count()
            store.close()
            if count >= at_least:
                return count
        time.sleep(0.2)
    raise AssertionError(f"auditor recorded fewer than {at_least} records in {timeout_s}s")


def test_restart_mid_stream_loses_and_repeats_nothing(own_nats, tmp_path):
    db = tmp_path / "audit.sqlite3"
    stack = Stack({"LF_NATS_URL": own_nats.url, "LF_DB_PATH": str(db), "LF_METRICS_PORT": "-1"}, tmp_path / "logs")
    try:
        asyncio.run(publish(own_nats.url, 0, 200))
        stack.start("auditor")
        wait_count(db, 50)
        stack.kill("auditor")  # SIGKILL, mid-stream or just after
        asyncio.run(publish(own_nats.url, 200, 400))
        stack.start("auditor")
        wait_count(db, 400)
        time.sleep(1)
    finally:
        stack.stop_all()
    store = AuditStore(db)
    rows = store.query(limit=1000)[::-1]
    assert [r.request_id for r in rows] == [f"req-{i}" for i in range(400)]
    assert [r.stream_seq for r in rows] == list(range(1, 401))
    assert store.verify() is None


def test_a_record_on_another_tenants_subject_is_not_recorded(own_nats, tmp_path):
    """Only audit(kind, tenant) of the record itself is a record: a client's redirected JetStream
    acknowledgement, or a record filed under another tenant, never enters the chain."""
    db = tmp_path / "audit.sqlite3"
    stack = Stack({"LF_NATS_URL": own_nats.url, "LF_DB_PATH": str(db), "LF_METRICS_PORT": "-1"}, tmp_path / "logs")

    async def misfile() -> None:
        nc = await nats.connect(own_nats.url)
        js = nc.jetstream()
        await ensure_streams(js)
        await js.publish(subjects.audit("completion", "globex"), encode(completion(0)))  # acme's, filed as globex's
        await js.publish(subjects.audit("completion", "globex"), b'{"stream":"INFER","seq":7}')
        await js.publish(subjects.audit("completion", "acme"), encode(completion(1)))
        await nc.close()

    try:
        asyncio.run(misfile())
        stack.start("auditor")
        wait_count(db, 1)
        time.sleep(1)
    finally:
        stack.stop_all()
    store = AuditStore(db)
    assert [(r.request_id, r.tenant_id) for r in store.query(limit=10)] == [("req-1", "acme")]
    assert store.verify() is None
