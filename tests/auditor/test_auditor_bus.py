"""The auditor's query handler served as the service serves it (typed, each request in its own
task) on a real nats-server, whose JetStream holds the signed heads; and the cross-check's reads
of the registry's records."""

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from services.auditor.chain import link
from services.auditor.head_log import HeadLog
from services.auditor.heads import HeadSigner, load_or_create_key
from services.auditor.service import Records, answer_query
from services.auditor.store import AuditStore
from services.auditor.verifier import ChainVerifier
from shared import subjects
from shared.bus import MAX_MESSAGE_BYTES, ensure_streams, request, serve
from shared.catalog.view import follow_catalog
from shared.errors import InvalidMessage, ServiceUnavailable
from shared.schemas import AuditQueryReply, AuditQueryRequest
from tests.helpers.records import make_record


def audit_record(i: int, tenant: str) -> dict:
    return {"kind": "completion", "tenant_id": tenant, "request_id": f"r{i}", "ts": time.time(), "n": i}


@pytest.fixture
def store(tmp_path: Path) -> AuditStore:
    store = AuditStore(tmp_path / "audit.db")
    for i, tenant in enumerate(("acme", "globex", "acme", "globex", "acme"), start=1):
        assert store.append(i, audit_record(i, tenant))
    return store


@dataclass
class Auditor:
    verifier: ChainVerifier
    nc: NATS
    subject: str  # this test's own auditor on the shared server

    async def query(self, timeout_s: float = 5, **fields: object) -> AuditQueryReply:
        return await request(self.nc, self.subject, AuditQueryRequest(**fields), AuditQueryReply, timeout_s)


@pytest.fixture
async def auditor(store: AuditStore, nats_url: str, tmp_path: Path) -> AsyncIterator[Auditor]:
    service = await nats.connect(nats_url)
    js = service.jetstream()
    await ensure_streams(js)
    chain_id = f"c{uuid.uuid4().hex[:10]}"
    verifier = ChainVerifier(store, HeadSigner(chain_id, load_or_create_key(tmp_path / "k")), HeadLog(js, chain_id))
    subject = f"{subjects.AUDITOR_QUERY}.{chain_id}"
    await serve(service, subject, AuditQueryRequest, partial(answer_query, store, verifier), concurrent=True)
    client = await nats.connect(nats_url)
    yield Auditor(verifier, client, subject)
    await client.close()
    await service.drain()


async def test_a_tenant_query_sees_its_own_records_only_newest_first(auditor: Auditor) -> None:
    reply = await auditor.query(tenant_id="acme")
    assert [r["request_id"] for r in reply.records] == ["r5", "r3", "r1"]
    assert {r["tenant_id"] for r in reply.records} == {"acme"}
    assert all(len(r["hash"]) == 64 for r in reply.records)
    assert (reply.chain, reply.next_cursor) == (None, None)  # only a platform query reports the chain
    assert (await auditor.query(tenant_id="globex", request_id="r1")).records == []


async def test_pages_run_newest_first_and_the_cursor_reaches_the_oldest(auditor: Auditor) -> None:
    first = await auditor.query(limit=2)
    assert ([r["n"] for r in first.records], first.next_cursor) == ([5, 4], 4)
    second = await auditor.query(limit=2, before=first.next_cursor)
    assert ([r["n"] for r in second.records], second.next_cursor) == ([3, 2], 2)
    last = await auditor.query(limit=2, before=second.next_cursor)
    assert ([r["n"] for r in last.records], last.next_cursor) == ([1], None)
    acme = await auditor.query(tenant_id="acme", limit=1, before=5)
    assert [r["n"] for r in acme.records] == [3]


async def test_a_reply_stays_under_the_message_limit_and_pages_the_rest(auditor: Auditor, store: AuditStore) -> None:
    for i in range(6, 1206):  # a burst of refusals with long reasons: 1,000 of them are > 2 MB
        assert store.append(i, {**audit_record(i, "acme"), "kind": "rejection", "reason": "x" * 1900})
    seen: list[int] = []
    before = None
    while True:
        reply = await auditor.query(kind="rejection", limit=1000, before=before)
        assert len(reply.model_dump_json()) <= MAX_MESSAGE_BYTES
        seen.extend(r["n"] for r in reply.records)
        if reply.next_cursor is None:
            break
        before = reply.next_cursor
    assert seen == list(range(1205, 5, -1))


async def test_a_platform_query_reports_the_chain_and_verify_rehashes_it(auditor: Auditor, tmp_path: Path) -> None:
    verifier = auditor.verifier
    await verifier.tick()
    reply = await auditor.query()
    assert reply.chain is not None
    assert (len(reply.records), reply.chain.intact, reply.chain.count, reply.chain.signed_pos) == (5, True, 5, 5)
    with sqlite3.connect(tmp_path / "audit.db") as db:  # an operator with shell access edits a record
        body = db.execute("SELECT body FROM audit WHERE pos = 3").fetchone()[0]
        db.execute("UPDATE audit SET body = ? WHERE pos = 3", (body.replace('"n":3', '"n":30'),))
    tampered = (await auditor.query(verify=True)).chain
    assert tampered is not None and (tampered.intact, tampered.broken_at) == (False, 3)


async def test_queries_are_answered_while_a_large_chain_is_verified(auditor: Auditor, tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "audit.db") as db:  # 400k records written straight into the file
        prev = db.execute("SELECT hash FROM audit WHERE pos = 5").fetchone()[0]
        rows = []
        for pos in range(6, 400_006):
            body = f'{{"kind":"completion","n":{pos},"tenant_id":"acme","ts":1}}'
            prev_hash, prev = prev, link(prev, pos, body)
            rows.append((pos, pos, "completion", "acme", 1.0, body, prev_hash, prev))
        db.executemany(
            "INSERT INTO audit (pos, stream_seq, kind, tenant_id, ts, body, prev_hash, hash)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    verifying = asyncio.create_task(auditor.query(timeout_s=120, limit=1, verify=True))
    await asyncio.sleep(0)  # the verify request goes out first
    answered = 0
    while not verifying.done() and answered < 5:
        assert (await auditor.query(tenant_id="acme", limit=1)).records[0]["n"] == 400_005
        answered += 1
    assert answered == 5 and not verifying.done()  # verification was still running: the loop was free
    chain = (await verifying).chain
    assert chain is not None and (chain.intact, chain.count) == (True, 400_005)


async def test_a_bad_query_gets_a_typed_refusal(auditor: Auditor) -> None:
    for body in (b'{"limit": 0}', b'{"tenant_id": "a b"}', b'{"before": 0}', b"{"):
        reply = await auditor.nc.request(auditor.subject, body, timeout=5)
        assert reply.headers == {"Lf-Error": "invalid_message"}
    with pytest.raises(InvalidMessage, match="AuditQueryRequest: limit"):
        await request(auditor.nc, auditor.subject, AuditQueryRequest.model_construct(limit=5000), AuditQueryReply, 5)


async def test_the_cross_check_reads_records_from_the_view_then_the_bucket(own_nats) -> None:
    """The cross-check's records come from the auditor's catalog view, else the records bucket itself
    (never a registry replica): an unknown version is None; the bucket unreachable is a typed 503."""
    nc = await nats.connect(own_nats.url)
    followed = None
    try:
        js = nc.jetstream(timeout=2)
        bucket = await js.create_key_value(bucket=subjects.REGISTRY_RECORDS_BUCKET)
        await bucket.put("sea.1", make_record("sea", 1, "demo").model_dump_json().encode())
        followed = await follow_catalog(nc, 2.0)
        records = Records(followed.view, js)
        assert (await records.get("sea", 1)).tenant_id == "demo"  # type: ignore[union-attr]
        assert await records.get("sea", 9) is None
        assert await records.get("sea", None) is None  # a completion that names no version
        followed.stop()  # the view stops; a version it never saw comes from the bucket itself
        await bucket.put("sea.2", make_record("sea", 2, "demo").model_dump_json().encode())
        assert followed.view.catalog.get("sea", 2) is None
        assert (await records.get("sea", 2)).version == 2  # type: ignore[union-attr]
        own_nats.stop()
        try:
            with pytest.raises(ServiceUnavailable, match="records bucket did not answer"):
                await records.get("sea", 3)
        finally:
            own_nats.start()
    finally:
        if followed is not None:
            followed.stop()
        await nc.close()
