"""The auditor's query handler served as the service serves it (``lf.auditor.query``, queue group
``auditor``), and its registry record cache, on the in-memory bus: no server process."""

import sqlite3
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from services.auditor.service import RecordCache, answer_query
from services.auditor.store import AuditStore
from shared import subjects
from shared.bus import request, serve
from shared.errors import InvalidMessage, ServiceUnavailable
from shared.memory_bus import MemoryBus
from shared.schemas import AdapterRecordsReply, AuditQueryReply, AuditQueryRequest, GetAdapterRequest
from tests.helpers.records import make_record


def audit_record(i: int, tenant: str) -> dict:
    return {"kind": "completion", "tenant_id": tenant, "request_id": f"r{i}", "ts": time.time(), "n": i}


@pytest.fixture
def store(tmp_path: Path) -> AuditStore:
    store = AuditStore(tmp_path / "audit.db")
    for i, tenant in enumerate(("acme", "globex", "acme", "globex", "acme"), start=1):
        assert store.append(i, audit_record(i, tenant))
    return store


@pytest.fixture
async def auditor(store: AuditStore) -> AsyncIterator[tuple[MemoryBus, NATS]]:
    bus = MemoryBus(seed=0)
    service = bus.connect("auditor")
    await serve(service, subjects.AUDITOR_QUERY, AuditQueryRequest, partial(answer_query, store), queue="auditor")
    client = bus.connect("gateway")
    yield bus, client
    await client.close()
    await service.drain()
    assert bus.errors == []


async def query(nc: NATS, **fields: object) -> AuditQueryReply:
    return await request(nc, subjects.AUDITOR_QUERY, AuditQueryRequest(**fields), AuditQueryReply, 5)


async def test_a_tenant_query_sees_its_own_records_only(auditor: tuple[MemoryBus, NATS]) -> None:
    _, nc = auditor
    reply = await query(nc, tenant_id="acme")
    assert [r["request_id"] for r in reply.records] == ["r1", "r3", "r5"]
    assert {r["tenant_id"] for r in reply.records} == {"acme"}
    assert all(len(r["hash"]) == 64 for r in reply.records)
    assert (reply.intact, reply.count) == (None, None)  # only a platform query proves the chain
    assert (await query(nc, tenant_id="globex", request_id="r1")).records == []
    assert [r["n"] for r in (await query(nc, tenant_id="acme", limit=2)).records] == [1, 3]


async def test_a_platform_query_proves_the_chain(auditor: tuple[MemoryBus, NATS], tmp_path: Path) -> None:
    _, nc = auditor
    reply = await query(nc)
    assert (len(reply.records), reply.intact, reply.broken_at, reply.count) == (5, True, None, 5)
    with sqlite3.connect(tmp_path / "audit.db") as db:  # an operator with shell access edits a record
        body = db.execute("SELECT body FROM audit WHERE pos = 3").fetchone()[0]
        db.execute("UPDATE audit SET body = ? WHERE pos = 3", (body.replace('"n":3', '"n":30'),))
    tampered = await query(nc)
    assert (tampered.intact, tampered.broken_at) == (False, 3)


async def test_a_bad_query_gets_a_typed_refusal(auditor: tuple[MemoryBus, NATS]) -> None:
    _, nc = auditor
    for body in (b'{"limit": 0}', b'{"tenant_id": "a b"}', b"{"):
        reply = await nc.request(subjects.AUDITOR_QUERY, body, timeout=5)
        assert reply.headers == {"Lf-Error": "invalid_message"}
    with pytest.raises(InvalidMessage, match="AuditQueryRequest: limit"):
        await request(nc, subjects.AUDITOR_QUERY, AuditQueryRequest.model_construct(limit=5000), AuditQueryReply, 5)


async def test_the_record_cache_asks_the_registry_once_per_version() -> None:
    bus = MemoryBus()
    registry = bus.connect("registry")
    asked: list[tuple[str, int | None]] = []
    known = {("sea", 1): make_record("sea", 1, "demo")}

    async def get(req: GetAdapterRequest) -> AdapterRecordsReply:
        asked.append((req.adapter_id, req.version))
        record = known.get((req.adapter_id, req.version or 0))
        return AdapterRecordsReply(records=[record] if record else [])

    cache = RecordCache(bus.connect("auditor"), timeout_s=1)
    with pytest.raises(ServiceUnavailable, match=r"nothing serves lf\.registry\.get"):  # registry not up yet
        await cache.get("sea", 1)
    await serve(registry, subjects.registry("get"), GetAdapterRequest, get)
    for _ in range(3):
        assert (await cache.get("sea", 1)).tenant_id == "demo"  # type: ignore[union-attr]
        assert await cache.get("sea", 9) is None  # an unknown version is remembered as such
    assert asked == [("sea", 1), ("sea", 9)]
