"""The registry's op table, wired by ``services.registry.service.subscribe`` exactly as the service
wires it, on the in-memory bus: typed replies, typed refusals, the isolation audit, and the
read-your-writes barrier with every catalog mirror (``CatalogBarrier``). No server process."""

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import BaseModel

from services.registry.evaluation import Ask
from services.registry.gate import GatePolicy
from services.registry.kv import StaleRecords
from services.registry.live_stats import LiveStats
from services.registry.ops import Registry
from services.registry.pin_ops import FleetSlots, Pins
from services.registry.push_admission import BaseModelIdentity, IntakePolicy
from services.registry.release_controller import ControllerConfig, ReleaseController
from services.registry.release_policy import ReleasePolicy
from services.registry.releases_kv import Stored
from services.registry.routing import Routing
from services.registry.service import subscribe
from services.registry.sources import Sources
from services.registry.stores import ApprovedStore
from services.registry.tenants import Tenants
from shared import subjects
from shared.adapter_format import AdapterLimits
from shared.bus import ERROR_HEADER, decode, encode, request
from shared.catalog.barrier import CatalogBarrier, answer_barrier
from shared.catalog.records import Catalog, record_key
from shared.catalog.view import CatalogView
from shared.errors import (
    AdapterNotReleased,
    Conflict,
    InvalidMessage,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PinsExceedSlots,
    ReleaseGateFailed,
    ServiceUnavailable,
    from_body,
)
from shared.eval_set import EvalItem, eval_set_digest
from shared.memory_bus import MemoryBus
from shared.metrics import QUALITY_SCORE
from shared.schemas import (
    AdapterRecordsReply,
    AdminAudit,
    ApiKeyCreatedReply,
    ApiKeysReply,
    AttachEvalSetRequest,
    AuditEnvelope,
    AuditEvent,
    CatalogSync,
    CatalogSynced,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ErrorBody,
    GetAdapterRequest,
    ListApiKeysRequest,
    ListPinsRequest,
    PinRequest,
    PinsReply,
    PoliciesReply,
    PolicyRule,
    PromoteRequest,
    RecordEvalRequest,
    RejectionAudit,
    ReleaseStartRequest,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    ResolveReply,
    ResolveRequest,
    RevokeApiKeyRequest,
    RoutesReply,
    ServiceHeartbeat,
    SetPoliciesRequest,
    SetRoutesRequest,
    SignerRecord,
    TenantsReply,
    WorkerHeartbeat,
)
from tests.helpers.records import make_record

SYNC_TIMEOUT_S = 0.3


class RecordsKVStub:
    """What the ops write through to KV, with its compare-and-set: the bucket's revision grows with
    every record written, and a batch planned from another revision of one of its keys is refused."""

    def __init__(self) -> None:
        self.records: list = []
        self.revisions: dict[str, int] = {}
        self.signers: dict[str, tuple[SignerRecord, int]] = {}
        self.signer_writes = 0

    async def commit(self, writes) -> list[int]:
        stale = [r for r, revision in writes if self.revisions.get(record_key(r.adapter_id, r.version), 0) != revision]
        if stale:
            raise StaleRecords(f"{stale[0].adapter_id} v{stale[0].version}")
        written = []
        for record, _ in writes:
            self.records.append(record)
            self.revisions[record_key(record.adapter_id, record.version)] = len(self.records)
            written.append(len(self.records))
        return written

    async def load_adapter(self, adapter_id: str) -> list:
        latest = {(r.adapter_id, r.version): r for r in self.records if r.adapter_id == adapter_id}
        return [(r, self.revisions[record_key(*k)]) for k, r in latest.items()]

    async def load_signer(self, name: str) -> tuple[SignerRecord | None, int]:
        return self.signers.get(name, (None, 0))

    async def put_signer(self, record: SignerRecord, revision: int | None = None) -> None:
        if revision is not None and self.signers.get(record.signer, (None, 0))[1] != revision:
            raise StaleRecords(record.signer)
        self.signer_writes += 1
        self.signers[record.signer] = (record, self.signer_writes)


class ReleasesKVStub:
    """The rollouts bucket: nothing started over this bus needs more than load and write."""

    def __init__(self) -> None:
        self.states: dict[str, Stored] = {}

    async def load(self) -> dict[str, Stored]:
        return dict(self.states)

    async def write(self, state, revision) -> int:
        self.states[state.adapter_id] = Stored(state, len(self.states) + 1)
        return len(self.states)


@dataclass
class Wired:
    bus: MemoryBus
    nc: NATS  # a client of the registry's, as the gateway or the CLI would be
    registry: Registry
    kv: RecordsKVStub
    barrier: CatalogBarrier
    tenant_writes: dict[str, bytes] = field(default_factory=dict)
    published: list[tuple[str, BaseModel]] = field(default_factory=list)
    pins: dict[str, bytes] = field(default_factory=dict)  # the lf_pins bucket
    fleet: FleetSlots = field(default_factory=lambda: FleetSlots(liveness_timeout_s=60))
    slot_quotas: dict[str, int] = field(default_factory=dict)  # tenant -> its own GPU slot quota
    worker: "ScriptedWorker" = field(default_factory=lambda: ScriptedWorker())

    async def call(self, op: str, message: BaseModel, reply: type[BaseModel]):
        return await request(self.nc, subjects.registry(op), message, reply, 5)


EVAL_SET = (
    '{"meta": {"threshold": 0.5, "max_tokens": 8}}\n'
    '{"prompt": "Capital of France?", "expected": "Paris", "scorer": "answer_format"}\n'
    '{"prompt": "Capital of Spain?", "expected": "Madrid", "scorer": "answer_format"}\n'
)


class ScriptedWorker:
    """What each version answers an eval item (by model ``<adapter>@<version>``): a stand-in for the
    scheduler and worker behind ``eval_client.asker``, whose real path tests/e2e/test_platform_eval.py runs."""

    def __init__(self) -> None:
        self.answers: dict[str, Callable[[EvalItem], str]] = {}
        self.asked: list[tuple[str, str, str, int]] = []  # (tenant, model, expected, max_tokens)

    def asker(self, tenant: str, base_model: str) -> Ask:
        async def ask(model: str, item: EvalItem, max_tokens: int) -> str:
            self.asked.append((tenant, model, item.expected, max_tokens))
            return self.answers[model](item)

        return ask


def right(item: EvalItem) -> str:
    return f"ANSWER: {item.expected}"


def wrong(item: EvalItem) -> str:
    return "I think it is Lyon."


@pytest.fixture
async def wired(base: BaseModelIdentity, tmp_path: Path) -> AsyncIterator[Wired]:
    bus = MemoryBus(seed=0)
    service_nc = bus.connect("registry")
    kv = RecordsKVStub()
    barrier = CatalogBarrier(service_nc, liveness_timeout_s=60, timeout_s=SYNC_TIMEOUT_S)
    catalog = Catalog(
        [
            make_record("sea", 1, "demo", status="production", traffic_percent=100, eval_results={"score": 0.9}),
            make_record("sea", 2, "demo"),
        ]
    )
    wired = Wired(bus, bus.connect("client"), None, kv, barrier)  # type: ignore[arg-type]
    wired.worker = ScriptedWorker()

    async def publish(subject: str, message: BaseModel) -> None:
        wired.published.append((subject, message))

    async def audit(event: AuditEvent) -> None:
        wired.published.append((subjects.audit(event.kind, event.tenant_id), AuditEnvelope(body=event)))

    async def put(key: str, value: bytes) -> None:
        wired.tenant_writes[key] = value

    wired.registry = Registry(
        catalog=catalog,
        signers={},
        kv=kv,  # type: ignore[arg-type]
        approved=ApprovedStore(None, subjects.ADAPTER_STORE_BUCKET, tmp_path / "store"),  # eval sets, here
        uploads=None,  # type: ignore[arg-type]
        base=base,
        policy=IntakePolicy(limits=AdapterLimits(max_rank=16, max_weights_bytes=1_000_000), dev_mode=False),
        trusted_dirs=(),
        remote=None,  # type: ignore[arg-type]  # only register reaches it
        publish=publish,
        audit=audit,
        gate=GatePolicy(require_eval=True),
        sync_views=barrier.wait,
        askers=wired.worker.asker,
    )

    sources: dict[str, bytes] = {}

    async def load() -> dict[str, bytes]:
        return dict(sources)

    async def put_source(key: str, value: bytes) -> None:
        sources[key] = value

    async def delete_source(key: str) -> None:
        sources.pop(key, None)

    async def load_pins() -> dict[str, bytes]:
        return dict(wired.pins)

    async def put_pin(key: str, value: bytes) -> None:
        wired.pins[key] = value

    async def delete_pin(key: str) -> None:
        del wired.pins[key]

    releases = ReleaseController(
        wired.registry,
        ReleasesKVStub(),  # type: ignore[arg-type]
        LiveStats(),
        ReleasePolicy(),
        ControllerConfig("reg-test", (1.0, 100.0), GatePolicy(require_eval=True), 10.0),
        audit,
    )
    routing_kv: dict[str, tuple[bytes, int]] = {}

    async def read_routing(key: str) -> tuple[bytes | None, int]:
        value, revision = routing_kv.get(key, (None, 0))
        return value, revision

    async def write_routing(key: str, value: bytes, revision: int) -> int:
        assert routing_kv.get(key, (b"", 0))[1] == revision
        routing_kv[key] = (value, revision + 1)
        return revision + 1

    async def synced(records: int, routing: int) -> set[str]:
        return set()

    await subscribe(
        service_nc,
        wired.registry,
        Tenants({}, put, audit),
        Sources(load, put_source, delete_source, audit),
        releases,
        Pins(catalog, wired.fleet, load_pins, put_pin, delete_pin, audit, wired.slot_quotas.get),
        Routing(catalog, read_routing, write_routing, audit, synced),
        [],  # in-memory state, no KV mirror to wait for
    )
    yield wired
    await wired.nc.close()
    await service_nc.drain()
    assert bus.errors == []


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


async def test_the_release_gate_refuses_then_promotion_waits_for_the_gateways(wired: Wired) -> None:
    promote = PromoteRequest(adapter_id="sea", version=2, traffic_percent=100, actor="t")
    with pytest.raises(ReleaseGateFailed, match="sea v2 has no eval set"):
        await wired.call("promote", promote, AdapterRecordsReply)
    assert wired.kv.records == [] and wired.published == []  # a refusal changes nothing
    claimed = RecordEvalRequest(adapter_id="sea", version=2, results={"score": 1.0, "threshold": 0.0}, actor="t")
    await wired.call("record_eval", claimed, AdapterRecordsReply)
    with pytest.raises(ReleaseGateFailed, match="sea v2 has no eval set"):  # a client's claim is advisory
        await wired.call("promote", promote, AdapterRecordsReply)

    # one live gateway that confirms every sync, as catalog_follow's on_sync does once its mirror caught up
    syncs: list[int] = []
    gateway = wired.bus.connect("gateway")

    async def on_sync(msg: Msg) -> None:
        syncs.append(decode(CatalogSync, msg.data).revision)
        await gateway.publish(msg.reply, encode(CatalogSynced(instance_id="gw1", revision=syncs[-1])))

    await gateway.subscribe(subjects.GATEWAY_CATALOG_SYNC, cb=on_sync)
    wired.barrier.on_heartbeat(ServiceHeartbeat(service="gateway", instance_id="gw1", ready=True))

    attach = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, actor="t")
    await wired.call("attach_eval_set", attach, AdapterRecordsReply)
    wired.worker.answers = {"sea@2": right, "sea@1": right}
    promoted = await wired.call("promote", promote, AdapterRecordsReply)
    assert [(r.version, r.status) for r in promoted.records] == [(1, "retired"), (2, "production")]
    assert syncs == [2, 3, 5]  # each write's records revision, confirmed before its reply
    [current] = (await wired.call("get", GetAdapterRequest(adapter_id="sea", version=2), AdapterRecordsReply)).records
    assert current.status == "production" and current.platform_eval is not None
    digest = eval_set_digest(EVAL_SET.encode())
    assert (current.platform_eval.eval_set_digest, current.platform_eval.score) == (digest, 1.0)
    assert (current.platform_eval.baseline_version, current.platform_eval.baseline_score) == (1, 1.0)
    # every item asked of both versions on the same set, as the owner tenant, greedy within the set's max_tokens
    assert sorted(wired.worker.asked) == sorted(
        ("demo", model, city, 8) for model in ("sea@1", "sea@2") for city in ("Paris", "Madrid")
    )
    kinds = [m.kind for s, m in wired.published if s.startswith("lf.adapter.event.")]  # type: ignore[attr-defined]
    assert kinds == ["evaluated", "eval_set_attached", "evaluated", "retired", "promoted"]
    assert QUALITY_SCORE.labels("sea", "2")._value.get() == 1.0  # the platform's score, not the client's claim
    assert wired.bus.subjects().count(subjects.GATEWAY_CATALOG_SYNC) == 1  # no sync inbox left behind


async def test_an_eval_set_that_fails_refuses_the_release_whatever_the_client_claimed(wired: Wired) -> None:
    claimed = RecordEvalRequest(adapter_id="sea", version=2, results={"score": 1.0, "threshold": 0.0}, actor="t")
    await wired.call("record_eval", claimed, AdapterRecordsReply)
    attach = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, actor="t")
    await wired.call("attach_eval_set", attach, AdapterRecordsReply)
    wired.worker.answers = {"sea@2": wrong, "sea@1": right}
    promote = PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, actor="t")
    with pytest.raises(ReleaseGateFailed, match=r"sea v2 scored 0\.000 .* under its release threshold 0\.500"):
        await wired.call("promote", promote, AdapterRecordsReply)
    [current] = (await wired.call("get", GetAdapterRequest(adapter_id="sea", version=2), AdapterRecordsReply)).records
    assert current.status == "staging" and current.eval_results["score"] == 1.0
    assert current.platform_eval is not None and current.platform_eval.score == 0.0
    assert QUALITY_SCORE.labels("sea", "2")._value.get() == 0.0
    asked = len(wired.worker.asked)
    with pytest.raises(ReleaseGateFailed, match="under its release threshold"):  # judged again, not run again
        await wired.call("promote", promote, AdapterRecordsReply)
    assert len(wired.worker.asked) == asked


async def test_a_regression_from_production_on_the_same_set_is_refused(wired: Wired) -> None:
    half = EVAL_SET.replace('"threshold": 0.5', '"threshold": 0.4')
    await wired.call(
        "attach_eval_set",
        AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=half, actor="t"),
        AdapterRecordsReply,
    )
    wired.worker.answers = {"sea@2": lambda item: right(item) if item.expected == "Paris" else "", "sea@1": right}
    promote = PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, actor="t")
    with pytest.raises(
        ReleaseGateFailed, match=r"scored 0\.500: a regression beyond 0\.050 from production v1 \(1\.000\)"
    ):
        await wired.call("promote", promote, AdapterRecordsReply)


async def test_only_an_explicit_audited_skip_passes_an_unevaluated_version(wired: Wired) -> None:
    with pytest.raises(ValueError, match="skip_eval needs a reason"):
        PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, skip_eval=True, actor="t")
    skip = PromoteRequest(adapter_id="sea", version=2, traffic_percent=10, skip_eval=True, reason="hotfix", actor="ops")
    promoted = await wired.call("promote", skip, AdapterRecordsReply)
    assert [(r.version, r.status) for r in promoted.records] == [(2, "canary")]
    [audit] = [m.body for s, m in wired.published if isinstance(m, AuditEnvelope)]
    assert audit.kind == "registry_change" and audit.action == "promoted"  # type: ignore[union-attr]
    assert audit.reason == "eval gate skipped by platform admin ops: hotfix"  # type: ignore[union-attr]
    assert wired.worker.asked == []


async def test_an_eval_set_is_validated_and_a_foreign_tenant_cannot_attach_one(wired: Wired) -> None:
    with pytest.raises(InvalidRequest, match="unknown scorer"):
        bad = EVAL_SET.replace("answer_format", "llm_judge")
        await wired.call(
            "attach_eval_set",
            AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=bad, actor="t"),
            AdapterRecordsReply,
        )
    foreign = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, tenant_id="other", actor="t")
    with pytest.raises(ModelNotFound):
        await wired.call("attach_eval_set", foreign, AdapterRecordsReply)
    assert wired.kv.records == []


async def test_an_eval_nobody_answered_is_no_score(wired: Wired) -> None:
    attach = AttachEvalSetRequest(adapter_id="sea", version=2, eval_set=EVAL_SET, actor="t")
    await wired.call("attach_eval_set", attach, AdapterRecordsReply)

    def down(item: EvalItem) -> str:
        raise ServiceUnavailable("no worker")

    wired.worker.answers = {"sea@2": down, "sea@1": right}
    with pytest.raises(ServiceUnavailable, match="no eval request of sea@2 was answered"):
        await wired.call("promote", PromoteRequest(adapter_id="sea", version=2, actor="t"), AdapterRecordsReply)
    [current] = (await wired.call("get", GetAdapterRequest(adapter_id="sea", version=2), AdapterRecordsReply)).records
    assert current.platform_eval is None and current.status == "staging"


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


async def test_a_release_start_is_gated_and_its_status_shows_the_refusal(wired: Wired) -> None:
    start = ReleaseStartRequest(adapter_id="sea", version=2, actor="t")
    with pytest.raises(ReleaseGateFailed, match="has no eval set"):
        await wired.call("release_start", start, ReleaseStatusReply)
    assert wired.kv.records == []  # the catalog is untouched
    status = await wired.call("release_status", ReleaseStatusRequest(), ReleaseStatusReply)
    [state] = status.releases
    assert (state.adapter_id, state.version, state.phase) == ("sea", 2, "gate_failed")
    assert state.decisions[-1].reasons == [
        "sea v2 has no eval set: push one with it (eval.jsonl) or attach one (`lorafleet adapter attach-eval sea 2 "
        "FILE`); only a platform admin may pass it unevaluated (--skip-eval, audited)"
    ]


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
