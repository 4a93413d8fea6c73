"""Pins through the admin API on a real registry: stored, listed, audited; another tenant's adapter is
the same 404 as a missing one and leaves no pin; the fleet's slots cap what may be pinned (409)."""

import uuid

import nats.errors
from nats.js.api import DeliverPolicy

from shared import subjects
from shared.bus import decode, encode
from shared.schemas import AuditEnvelope, WorkerHeartbeat
from tests.gateway.adapters import make_adapter, release
from tests.gateway.conftest import BASE


async def _audit_trail(nc, tenant: str) -> list[tuple[str, str, dict]]:
    """Every pin record of the tenant on the AUDIT stream: (action, target, detail)."""
    sub = await nc.jetstream().subscribe(subjects.audit("admin", tenant), stream=subjects.AUDIT_STREAM,
                                         ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)  # fmt: skip
    trail = []
    try:
        while True:  # the records are stored before each op answers: a quiet second means the end
            try:
                msg = await sub.next_msg(timeout=1)
            except nats.errors.TimeoutError:
                break
            body = decode(AuditEnvelope, msg.data).body
            if body.action in ("adapter_pinned", "adapter_unpinned"):
                trail.append((body.action, body.target, body.detail))
    finally:
        await sub.unsubscribe()
    return trail


async def test_a_tenant_admin_pins_and_unpins_its_own_adapter_and_each_change_is_audited(gateway, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    tenant, key = await gateway.tenant(f"p{suffix}", scopes=("admin", "inference"))
    other, other_key = await gateway.tenant(f"q{suffix}", scopes=("admin", "inference"))
    adapter = f"p{suffix}-a"
    async with gateway.client(key) as c:
        await release(c, make_adapter(tmp_path / adapter), adapter)
        pinned = await c.post(f"/admin/adapters/{adapter}/pin")
        assert pinned.status_code == 200, pinned.text
        on_w1 = await c.post(f"/admin/adapters/{adapter}/pin", json={"worker": "w1", "version": 1})
        assert [(p["version"], p["worker_id"], p["tenant_id"]) for p in on_w1.json()["pins"]] == [
            (None, None, tenant),
            (1, "w1", tenant),
        ]
        assert (await c.get(f"/admin/adapters/{adapter}/pins")).json() == on_w1.json()
        bad = await c.post(f"/admin/adapters/{adapter}/pin", json={"worker": "w.>"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        missing = await c.post(f"/admin/adapters/{adapter}/pin", json={"version": 7})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "version"
    async with gateway.client(other_key) as c:  # another tenant's admin: the same 404 as a missing adapter
        for path in ("pin", "unpin"):
            answers = [await c.post(f"/admin/adapters/{m}/{path}") for m in (adapter, "nothing-here")]
            assert [a.status_code for a in answers] == [404, 404]
            assert answers[0].text.replace(adapter, "M") == answers[1].text.replace("nothing-here", "M")
    async with gateway.client(key) as c:
        assert (await c.get(f"/admin/adapters/{adapter}/pins")).json() == on_w1.json()  # the refusals pinned nothing
        left = await c.post(f"/admin/adapters/{adapter}/unpin", json={"worker": "w1", "version": 1})
        assert left.status_code == 200 and [p["worker_id"] for p in left.json()["pins"]] == [None]
        again = await c.post(f"/admin/adapters/{adapter}/unpin", json={"worker": "w1", "version": 1})
        assert again.status_code == 404
    async with gateway.client(await gateway.key(tenant)) as c:  # an inference key manages nothing
        assert (await c.post(f"/admin/adapters/{adapter}/pin")).status_code == 403
    async with gateway.client(gateway.admin_key) as c:  # a platform admin manages any tenant's pins
        assert (await c.post(f"/admin/adapters/{adapter}/unpin")).json() == {"pins": []}
    assert await _audit_trail(gateway.nc, tenant) == [
        ("adapter_pinned", adapter, {"version": None, "worker_id": None}),
        ("adapter_pinned", adapter, {"version": 1, "worker_id": "w1"}),
        ("adapter_unpinned", adapter, {"version": 1, "worker_id": "w1"}),
        ("adapter_unpinned", adapter, {"version": None, "worker_id": None}),
    ]
    assert await _audit_trail(gateway.nc, other) == []


async def test_a_pin_past_a_live_workers_slots_is_409_pins_exceed_slots(gateway, tmp_path):
    tenant, key = await gateway.tenant(scopes=("admin", "inference"))
    beat = WorkerHeartbeat(worker_id="small", base_model=BASE, ready=True, running=0, waiting=0, max_running=2,
                           kv_blocks_free=1, kv_blocks_total=1, slots={"8": [0, 2], "16": [0, 2]})  # fmt: skip
    await gateway.nc.publish(subjects.WORKER_HEARTBEAT, encode(beat))
    async with gateway.client(key) as c:
        for adapter in (f"{tenant}-x", f"{tenant}-y"):
            await release(c, make_adapter(tmp_path / adapter), adapter)
        assert (await c.post(f"/admin/adapters/{tenant}-x/pin")).status_code == 200
        refused = await c.post(f"/admin/adapters/{tenant}-y/pin")
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "pins_exceed_slots" and "worker small has 2 rank-8 slots" in error["message"]
        assert (await c.post(f"/admin/adapters/{tenant}-y/pin", json={"worker": "big"})).status_code == 200
