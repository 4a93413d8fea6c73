"""The registry's op table, wired by ``services.registry.service.subscribe`` exactly as the service
wires it, on the in-memory bus: typed replies, typed refusals, the isolation audit, and the
read-your-writes barrier with every catalog mirror (``CatalogBarrier``). No server process."""

import asyncio

import pytest
from pydantic import BaseModel

from shared import subjects
from shared.bus import ERROR_HEADER, decode
from shared.catalog.barrier import CatalogBarrier, answer_barrier
from shared.catalog.view import CatalogView
from shared.errors import (
    AdapterNotReleased,
    Conflict,
    InvalidMessage,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PinsExceedSlots,
    from_body,
)
from shared.schemas import (
    AdapterRecordsReply,
    AdminAudit,
    ApiKeyCreatedReply,
    ApiKeysReply,
    AuditEnvelope,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ErrorBody,
    ListApiKeysRequest,
    ListPinsRequest,
    PinRequest,
    PinsReply,
    PoliciesReply,
    PolicyRule,
    RecordEvalRequest,
    RejectionAudit,
    ResolveReply,
    ResolveRequest,
    RevokeApiKeyRequest,
    RoutesReply,
    ServiceHeartbeat,
    SetPoliciesRequest,
    SetRoutesRequest,
    TenantsReply,
    WorkerHeartbeat,
)
from tests.helpers.records import make_record
from tests.registry.bus_world import (
    SYNC_TIMEOUT_S,
    Wired,
)


async def test_every_op_is_served(wired: Wired) -> None:
    assert sorted(wired.bus.subjects()) == sorted(subjects.registry(op) for op in subjects.REGISTRY_OPS)


async def test_tenants_and_keys_answer_typed_replies_and_refusals(wired: Wired) -> None:
    created = await wired.call("tenant_create", CreateTenantRequest(tenant_id="acme", actor="t"), TenantsReply)
    assert [t.tenant_id for t in created.tenants] == ["acme"]
    assert "tenant.acme" in wired.tenant_writes  # written through before the reply
    with pytest.raises(Conflict, match="tenant 'acme' already exists"):
        await wired.call("tenant_create", CreateTenantRequest(tenant_id="acme", actor="t"), TenantsReply)
    with pytest.raises(InvalidRequest) as reserved:
        await wired.call("tenant_create", CreateTenantRequest(tenant_id="shared", actor="t"), TenantsReply)
    assert (type(reserved.value), reserved.value.param) == (InvalidRequest, "tenant_id")
    with pytest.raises(NotFound) as missing:
        await wired.call("api_key_create", CreateApiKeyRequest(tenant_id="nobody", actor="t"), ApiKeyCreatedReply)
    assert missing.value.param == "tenant_id"

    key = await wired.call("api_key_create", CreateApiKeyRequest(tenant_id="acme", actor="t"), ApiKeyCreatedReply)
    listed = await wired.call("api_keys", ListApiKeysRequest(tenant_id="acme"), ApiKeysReply)
    assert [k.key_id for k in listed.keys] == [key.info.key_id]
    assert key.key not in listed.model_dump_json()  # the secret is in the create reply only
    with pytest.raises(NotFound):  # another tenant's key answers as a missing one
        await wired.call(
            "api_key_revoke", RevokeApiKeyRequest(key_id=key.info.key_id, tenant_id="other", actor="t"), ApiKeysReply
        )
    revoked = await wired.call("api_key_revoke", RevokeApiKeyRequest(key_id=key.info.key_id, actor="t"), ApiKeysReply)
    assert revoked.keys[0].revoked


class LooseTenant(BaseModel):
    tenant_id: str
    actor: str = "t"


async def test_bad_input_is_refused_before_any_handler(wired: Wired) -> None:
    with pytest.raises(InvalidMessage, match="CreateTenantRequest: tenant_id: String should match pattern"):
        await wired.call("tenant_create", LooseTenant(tenant_id="no spaces allowed"), TenantsReply)
    for body in (b"not json", b"{}", b"[1]"):
        reply = await wired.nc.request(subjects.registry("tenant_create"), body, timeout=5)
        assert reply.headers == {ERROR_HEADER: "invalid_message"}
        error = from_body(decode(ErrorBody, reply.data))
        assert type(error) is InvalidMessage and error.message.startswith("CreateTenantRequest: ")
    assert wired.tenant_writes == {}


async def test_resolve_keeps_tenants_apart_and_audits_the_attempt(wired: Wired) -> None:
    own = await wired.call("resolve", ResolveRequest(tenant_id="demo", model="sea", request_key="r1"), ResolveReply)
    assert own.adapter is not None and (own.adapter.adapter_id, own.adapter.version) == ("sea", 1)
    base = await wired.call(
        "resolve", ResolveRequest(tenant_id="other", model=wired.registry._base.name, request_key="r2"), ResolveReply
    )
    assert base.adapter is None
    with pytest.raises(AdapterNotReleased):  # a pinned staging version is not served without preview
        await wired.call("resolve", ResolveRequest(tenant_id="demo", model="sea@2", request_key="r3"), ResolveReply)

    answers = []
    for model in ("sea", "no-such-adapter"):
        with pytest.raises(ModelNotFound) as refused:
            await wired.call("resolve", ResolveRequest(tenant_id="other", model=model, request_key="r4"), ResolveReply)
        answers.append((type(refused.value), refused.value.status))
    assert answers[0] == answers[1] == (ModelNotFound, 404)  # foreign and missing look alike
    for _ in range(100):  # the isolation audit is published after the answer
        if wired.published:
            break
        await asyncio.sleep(0.01)
    [(subject, envelope)] = wired.published
    assert subject == subjects.audit("rejection", "other")
    assert isinstance(envelope, AuditEnvelope) and isinstance(envelope.body, RejectionAudit)
    assert envelope.body.code == "tenant_isolation_attempt"


async def test_a_silent_gateway_delays_a_write_by_the_bound_only(wired: Wired) -> None:
    wired.barrier.on_heartbeat(ServiceHeartbeat(service="gateway", instance_id="ghost", ready=True))
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await wired.barrier.wait(7) == {"gateway/ghost"}
    assert loop.time() - started >= SYNC_TIMEOUT_S
    evaluated = RecordEvalRequest(adapter_id="sea", version=2, results={"score": 0.95}, actor="t")
    reply = await wired.call("record_eval", evaluated, AdapterRecordsReply)  # the write stands
    assert reply.records[0].eval_results["score"] == 0.95


async def test_a_write_waits_for_every_ready_scheduler_and_worker_mirror_too(wired: Wired) -> None:
    """Before: the barrier counted gateways only, so a rollback returned while the scheduler's mirror
    (which resolves direct-NATS submissions) and the workers' could still hold the state before it."""
    barrier = CatalogBarrier(wired.bus.connect("registry-barrier"), liveness_timeout_s=60, timeout_s=30)
    mirrors = {}
    for service, instance in (("gateway", "0"), ("scheduler", "0"), ("worker", "w1")):
        mirrors[service] = CatalogView()
        mirrors[service].mark_loaded()
        await answer_barrier(wired.bus.connect(service), service, instance, mirrors[service], 30)
        barrier.on_heartbeat(ServiceHeartbeat(service=service, instance_id=instance, ready=True))
    # a worker still loading its base model heartbeats before it follows the catalog: not waited for
    barrier.on_heartbeat(ServiceHeartbeat(service="worker", instance_id="loading", ready=False))
    for service in ("gateway", "worker"):
        mirrors[service].apply("sea.1", None, 4)
    waiting = asyncio.create_task(barrier.wait(4))
    await asyncio.sleep(0.1)
    assert not waiting.done()  # one scheduler's mirror (instance id 0, as the gateway's) is behind
    mirrors["scheduler"].apply("sea.1", None, 4)
    assert await waiting == set()


def _pin(adapter_id: str = "sea", **fields) -> PinRequest:
    return PinRequest(adapter_id=adapter_id, actor="apikey:k1", **fields)


async def test_a_pin_is_stored_listed_audited_and_unpinned_by_its_owner_only(wired: Wired) -> None:
    reply = await wired.call("pin", _pin(tenant_id="demo"), PinsReply)
    (pin,) = reply.pins
    assert (pin.adapter_id, pin.tenant_id, pin.version, pin.worker_id) == ("sea", "demo", None, None)
    assert list(wired.pins) == ["sea.fleet.served"] == [pin.key]  # written through before the reply
    on_w2 = await wired.call("pin", _pin(tenant_id="demo", version=2, worker_id="w2"), PinsReply)
    assert [p.key for p in on_w2.pins] == ["sea.fleet.served", "sea.w-w2.v2"]
    again = await wired.call("pin", _pin(tenant_id="demo"), PinsReply)  # the same pin again changes nothing
    assert again == on_w2
    for foreign in (_pin(tenant_id="other"), _pin("nope", tenant_id="demo")):  # another's adapter = a missing one
        with pytest.raises(NotFound, match="does not exist or you do not have access to it"):
            await wired.call("pin", foreign, PinsReply)
    with pytest.raises(NotFound, match="does not exist or you do not have access"):
        await wired.call("unpin", _pin(tenant_id="other"), PinsReply)
    with pytest.raises(NotFound, match="no version 9"):
        await wired.call("pin", _pin(tenant_id="demo", version=9), PinsReply)
    with pytest.raises(NotFound, match="has no such pin"):
        await wired.call("unpin", _pin(tenant_id="demo", worker_id="w1"), PinsReply)
    assert len(wired.pins) == 2  # refusals store nothing
    listed = await wired.call("pins", ListPinsRequest(tenant_id="other"), PinsReply)
    assert listed.pins == []
    left = await wired.call("unpin", _pin(worker_id="w2", version=2), PinsReply)  # an operator: any adapter
    assert [p.key for p in left.pins] == ["sea.fleet.served"] and list(wired.pins) == ["sea.fleet.served"]
    audits = [m.body for s, m in wired.published if isinstance(m, AuditEnvelope) and isinstance(m.body, AdminAudit)]
    trail = [(a.action, a.tenant_id, a.target, a.actor, a.detail) for a in audits]
    assert trail == [
        ("adapter_pinned", "demo", "sea", "apikey:k1", {"version": None, "worker_id": None}),
        ("adapter_pinned", "demo", "sea", "apikey:k1", {"version": 2, "worker_id": "w2"}),
        ("adapter_unpinned", "demo", "sea", "apikey:k1", {"version": 2, "worker_id": "w2"}),
    ]


async def test_pins_beyond_a_live_workers_slots_but_one_are_refused_typed(wired: Wired) -> None:
    catalog = wired.registry.catalog
    for i in range(3):
        catalog.put(make_record(f"p{i}", 1, "demo", status="production", traffic_percent=100))
    catalog.put(make_record("big", 1, "demo", rank=16, status="production", traffic_percent=100))
    beat = {"base_model": "tiny-llama", "ready": True, "running": 0, "waiting": 0, "max_running": 4,
            "kv_blocks_free": 1, "kv_blocks_total": 1}  # fmt: skip
    wired.fleet.on_heartbeat(WorkerHeartbeat(worker_id="w1", slots={"8": [0, 3], "16": [0, 1]}, **beat))
    wired.fleet.on_heartbeat(WorkerHeartbeat(worker_id="w2", slots={"8": [0, 2], "16": [0, 2]}, **beat))
    await wired.call("pin", _pin("p0"), PinsReply)
    with pytest.raises(PinsExceedSlots, match="worker w2 has 2 rank-8 slots: pins may hold 1"):
        await wired.call("pin", _pin("p1"), PinsReply)  # w2's second rank-8 slot stays unpinned
    await wired.call("pin", _pin("p1", worker_id="w1"), PinsReply)  # w1 has room for two
    with pytest.raises(PinsExceedSlots, match="worker w1 has 3 rank-8 slots"):
        await wired.call("pin", _pin("p2", worker_id="w1"), PinsReply)
    with pytest.raises(PinsExceedSlots, match="worker w1 has 1 rank-16 slots: pins may hold 0"):
        await wired.call("pin", _pin("big"), PinsReply)
    await wired.call("pin", _pin("big", worker_id="w2"), PinsReply)
    assert sorted(wired.pins) == ["big.w-w2.served", "p0.fleet.served", "p1.w-w1.served"]


async def test_a_tenant_pins_no_more_of_a_workers_rank_class_than_its_own_slot_quota(wired: Wired) -> None:
    for i in range(2):
        wired.registry.catalog.put(make_record(f"q{i}", 1, "demo", status="production", traffic_percent=100))
    beat = {"base_model": "tiny-llama", "ready": True, "running": 0, "waiting": 0, "max_running": 4,
            "kv_blocks_free": 1, "kv_blocks_total": 1}  # fmt: skip
    wired.fleet.on_heartbeat(WorkerHeartbeat(worker_id="w1", slots={"8": [0, 8]}, **beat))
    wired.slot_quotas["demo"] = 1
    await wired.call("pin", _pin("q0", tenant_id="demo"), PinsReply)
    with pytest.raises(PinsExceedSlots, match="tenant demo may hold 1 rank-8 slots of a worker"):
        await wired.call("pin", _pin("q1", tenant_id="demo"), PinsReply)  # pinning never lifts the slot quota
    wired.slot_quotas["demo"] = 2
    await wired.call("pin", _pin("q1", tenant_id="demo"), PinsReply)


async def test_task_routes_and_policies_are_versioned_audited_and_name_only_usable_adapters(wired: Wired) -> None:
    first = await wired.call(
        "routes_set", SetRoutesRequest(tenant_id="demo", routes={"sql": {"adapter": "sea"}}, actor="t"), RoutesReply
    )
    second = await wired.call(
        "routes_set",
        SetRoutesRequest(tenant_id="demo", routes={"sql": {"adapter": "sea", "version": 1}}, actor="t"),
        RoutesReply,
    )
    assert (first.routes.revision, second.routes.revision) == (1, 2)
    with pytest.raises(NotFound):  # another tenant's adapter: the same 404 as a missing one
        await wired.call(
            "routes_set", SetRoutesRequest(tenant_id="acme", routes={"x": {"adapter": "sea"}}, actor="t"), RoutesReply
        )
    with pytest.raises(NotFound):
        await wired.call(
            "routes_set",
            SetRoutesRequest(tenant_id="demo", routes={"x": {"adapter": "sea", "version": 9}}, actor="t"),
            RoutesReply,
        )
    refuse = PolicyRule.model_validate({"name": "r", "target": {"kind": "refuse"}})
    platform = await wired.call("policies_set", SetPoliciesRequest(rules=[refuse], actor="t"), PoliciesReply)
    assert platform.policies.tenant_id is None and platform.policies.revision == 1
    audits = [m.body for s, m in wired.published if isinstance(m, AuditEnvelope) and isinstance(m.body, AdminAudit)]
    trail = [(a.action, a.tenant_id, a.detail["revision"]) for a in audits]
    assert trail == [
        ("task_routes_set", "demo", 1),
        ("task_routes_set", "demo", 2),
        ("route_policies_set", "shared", 1),
    ]
