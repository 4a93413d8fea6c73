"""The registry's op table on the in-memory bus, wired by ``services.registry.service.subscribe``
exactly as the service wires it: stub KV stores, a scripted worker for the release gate's eval
requests, and the ``wired`` fixture (registered in tests/registry/conftest.py)."""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from pydantic import BaseModel

from services.registry.evaluation import Ask
from services.registry.experiment_stats import ExperimentStats
from services.registry.experiments import Experiments
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
from shared.bus import request
from shared.catalog.barrier import CatalogBarrier
from shared.catalog.records import Catalog, record_key
from shared.catalog.routing import Routes
from shared.eval_set import EvalItem
from shared.memory_bus import MemoryBus
from shared.schemas import (
    AuditEnvelope,
    AuditEvent,
    SignerRecord,
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
    routes: Routes = field(default_factory=Routes)  # the registry's mirror of the lf_routing bucket
    experiment_stats: ExperimentStats = field(default_factory=ExperimentStats)

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
        wired.routes.apply(key, value, revision + 1)
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
        Experiments(catalog, wired.routes, wired.experiment_stats, read_routing, write_routing, audit, synced),
        [],  # in-memory state, no KV mirror to wait for
    )
    yield wired
    await wired.nc.close()
    await service_nc.drain()
    assert bus.errors == []
