"""A foreign adapter's 404 leaves as fast as a missing one's: its isolation audit is published after."""

import asyncio
import time

import pytest

from services.registry.ops import Registry
from shared import subjects
from shared.catalog.records import Catalog
from shared.errors import ModelNotFound
from shared.schemas import AuditEnvelope, ResolveRequest
from tests.helpers.records import make_record


async def test_the_isolation_audit_does_not_delay_the_answer(base):
    published: list[tuple[str, object]] = []

    async def publish(subject: str, message) -> None:
        published.append((subject, message))

    async def slow_audit(event) -> None:
        await asyncio.sleep(0.5)  # a JetStream publish waiting for its ack
        published.append((subjects.audit(event.kind, event.tenant_id), AuditEnvelope(body=event)))

    catalog = Catalog([make_record("globex-sql", 1, "globex", status="production", traffic_percent=100)])
    registry = Registry(
        catalog=catalog,
        signers={},
        kv=None,
        approved=None,
        uploads=None,
        base=base,
        policy=None,
        trusted_dirs=(),
        remote=None,
        publish=publish,
        audit=slow_audit,
    )
    for model in ("globex-sql", "nobody-sql"):
        started = time.monotonic()
        with pytest.raises(ModelNotFound):
            await registry.resolve(ResolveRequest(tenant_id="acme", model=model, request_key="k", route="nats"))
        assert time.monotonic() - started < 0.2
    await asyncio.sleep(0.7)
    assert len(published) == 1  # the foreign attempt only, audited all the same
    subject, envelope = published[0]
    assert subject.endswith(".acme") and envelope.body.code == "tenant_isolation_attempt"
    assert envelope.body.route == "nats"  # the path that asked: counted by it (tenant_isolation_errors_total)
