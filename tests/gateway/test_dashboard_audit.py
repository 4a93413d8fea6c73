"""/dashboard/data with a real auditor behind it: a burst of refusals larger than one NATS message
still answers 200, showing the newest records first."""

import asyncio
import time
from pathlib import Path

from services.auditor.service import run as run_auditor
from services.auditor.settings import AuditorSettings
from services.auditor.store import AuditStore
from shared.audit_publish import publish_audit
from shared.schemas import RejectionAudit
from tests.gateway.conftest import Gateway

BURST = 1_200  # at ~2 KB each, 1,000 of them are twice NATS's 1 MiB message limit


async def test_a_burst_of_refusals_keeps_the_dashboard_up(gateway: Gateway, gw_nats, tmp_path: Path) -> None:
    db = tmp_path / "audit.sqlite3"
    settings = AuditorSettings(
        nats_url=gw_nats.url, db_path=str(db), metrics_port=-1, head_interval_s=0.2, chain_id="dash"
    )
    stop = asyncio.Event()
    auditor = asyncio.create_task(run_auditor(settings, stop))
    try:
        js = gateway.nc.jetstream()  # type: ignore[attr-defined]
        for i in range(BURST):
            refusal = RejectionAudit(
                request_id=f"push-{i}", tenant_id="acme", service="registry", code="integrity_error", reason="x" * 1900
            )
            assert await publish_audit(js, refusal, f"dash-{i}")
        deadline = time.monotonic() + 60
        while not db.exists() or AuditStore(db).last_pos() < BURST:
            assert time.monotonic() < deadline, "the auditor did not index the burst"
            await asyncio.sleep(0.2)
        async with gateway.client(gateway.admin_key) as http:
            reply = await http.get("/dashboard/data")
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert "auditor" not in data["unavailable"]
        assert [r["request_id"] for r in data["audit"]] == [f"push-{i}" for i in range(BURST - 1, BURST - 26, -1)]
        assert data["audit_intact"] is True
    finally:
        stop.set()
        await auditor
