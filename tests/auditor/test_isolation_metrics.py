"""The auditor counts refused cross-tenant attempts by the route that refused them
(``tenant_isolation_errors_total{route}``) and, apart, completions its cross-check finds served
across tenants (``tenant_isolation_violations_total``)."""

import asyncio

from services.auditor.service import Records, _record
from services.auditor.store import AuditStore
from shared import metrics
from shared.catalog.view import CatalogView
from shared.schemas import CompletionAudit, RejectionAudit
from tests.helpers.records import make_record


def _attempts(route: str) -> float:
    return metrics.TENANT_ISOLATION_ERRORS.labels(route)._value.get()


def _violations() -> float:
    return metrics.TENANT_ISOLATION_VIOLATIONS._value.get()


def _rejection(i: int, code: str, route=None) -> RejectionAudit:
    return RejectionAudit(request_id=f"r{i}", tenant_id="acme", service="x", code=code, reason="r", route=route)


async def test_refused_attempts_count_by_route_and_violations_apart(tmp_path) -> None:
    store = AuditStore(str(tmp_path / "audit.db"))
    view = CatalogView()
    view.catalog.put(make_record("globex-sql", 1, "globex", status="production"))
    records = Records(view, None)  # type: ignore[arg-type]  # every record read is in the view
    before = {route: _attempts(route) for route in ("http", "nats", "dispatch", "unknown")}
    violations = _violations()
    events = [
        _rejection(1, "tenant_isolation_attempt", "http"),
        _rejection(2, "tenant_isolation_attempt", "nats"),
        _rejection(3, "tenant_isolation_attempt", "nats"),
        _rejection(4, "tenant_isolation_attempt"),  # a record written before routes were named
        _rejection(5, "forbidden", "http"),  # another refusal: not an isolation attempt
    ]
    served_across = CompletionAudit.model_validate(
        {
            "request_id": "c1",
            "tenant_id": "acme",
            "base_model": "tiny-llama",
            "adapter_id": "globex-sql",
            "adapter_version": 1,
            "adapter_digest": make_record("globex-sql", 1, "globex").digest,
            "cache_hit": False,
            "ttft_ms": 1.0,
            "tpot_ms": 1.0,
            "prompt_tokens": 1,
            "completion_tokens": 1,
            "worker_id": "w1",
            "outcome": "stop",
        }
    )
    try:
        for seq, event in enumerate([*events, served_across], start=1):
            await _record(store, records, seq, event, asyncio.Event())
    finally:
        store.close()
    assert {r: _attempts(r) - before[r] for r in before} == {"http": 1, "nats": 2, "dispatch": 0, "unknown": 1}
    assert _violations() - violations == 1
