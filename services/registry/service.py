"""Registry service wiring: connect, open the stores, serve ``lf.registry.<op>``, heartbeat."""

import asyncio
import functools
import gc
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from pydantic import BaseModel

from services.registry.eval_client import asker
from services.registry.experiment_stats import ExperimentStats
from services.registry.experiments import Experiments
from services.registry.fleet_ranks import FleetRanks
from services.registry.gate import GatePolicy
from services.registry.kv import RecordsKV, publish_registry_audit
from services.registry.ops import Registry
from services.registry.pin_ops import FleetSlots, Pins
from services.registry.pins_kv import open_pins
from services.registry.push_admission import BaseModelIdentity, IntakePolicy
from services.registry.release_controller import ReleaseController
from services.registry.release_service import drive_releases, follow_since, start_controller
from services.registry.remote_fetch import RemoteFetcher, Resolver, system_resolve
from services.registry.remote_intake import RemoteIntake
from services.registry.routing import Routing
from services.registry.routing_kv import open_experiments, open_routing
from services.registry.settings import RegistrySettings
from services.registry.sources import Sources
from services.registry.sources_kv import open_sources
from services.registry.stores import Uploads, open_approved_store, open_object_store
from services.registry.tenants import Tenants
from services.registry.tenants_kv import open_tenants
from shared import event_loop, subjects
from shared.adapter_format import AdapterLimits
from shared.base_model import resolve_model_dir, served_model_name
from shared.bus import connect, decode, drain_or_close, encode, ensure_streams, serve, shutdown_event
from shared.catalog.barrier import CatalogBarrier
from shared.catalog.records import Catalog
from shared.catalog.routing import Routes
from shared.config import load_settings
from shared.errors import LorafleetError, ServiceUnavailable
from shared.fingerprint import BaseModelSpec, fingerprint_model_dir
from shared.heartbeat import publish_heartbeats
from shared.kv_follow import Apply, Position, StaleMirror, follow_bucket
from shared.logs import configure_logging
from shared.metrics_http import serve_metrics
from shared.schemas import (
    AddSourceRequest,
    ApproveSourceRequest,
    AttachEvalSetRequest,
    CreateApiKeyRequest,
    CreateExperimentRequest,
    CreateTenantRequest,
    DeleteRoutesRequest,
    ExperimentStateRequest,
    GetAdapterRequest,
    GetExperimentRequest,
    GetPoliciesRequest,
    GetRoutesRequest,
    ListAdaptersRequest,
    ListApiKeysRequest,
    ListExperimentsRequest,
    ListKeysRequest,
    ListModelsRequest,
    ListPinsRequest,
    ListSourcesRequest,
    ListTenantsRequest,
    PinRequest,
    PromoteRequest,
    RecordEvalRequest,
    RegisterRequest,
    ReleaseStartRequest,
    ReleaseStatusRequest,
    RemoveSourceRequest,
    ResolveRequest,
    RetireRequest,
    RevokeApiKeyRequest,
    RevokeRequest,
    RollbackRequest,
    RolloutRequest,
    ServiceHeartbeat,
    SetPoliciesRequest,
    SetQuotaRequest,
    SetRoutesRequest,
    TrustKeyRequest,
    UntrustKeyRequest,
    WorkerHeartbeat,
)
from shared.slot_size import DTYPE_BYTES
from shared.telemetry import setup_tracing

log = structlog.get_logger("registry")
QUEUE = "registry"  # every replica serves the ops; NATS gives each request to one of them

M = TypeVar("M", bound=BaseModel)
# an op's request model and its handler; _op checks that the handler takes that model
Handler = tuple[type[BaseModel], Callable[[Any], Awaitable[BaseModel]]]


def checks_off(settings: RegistrySettings) -> list[str]:
    """The release checks this registry runs without, which its heartbeats report to /readyz."""
    checks = {"release_require_eval": settings.release_require_eval, "release_gate": settings.release_gate}
    return [name for name, on in checks.items() if not on]


def base_model_identity(settings: RegistrySettings) -> BaseModelIdentity:
    cache = Path(settings.model_cache) if settings.model_cache else None
    directory = resolve_model_dir(settings.model_dir, cache)
    return BaseModelIdentity(
        name=served_model_name(settings.model_dir, directory),
        fingerprint=fingerprint_model_dir(directory),
        spec=BaseModelSpec.from_model_dir(directory),
    )


async def open_registry(
    nc: NATS,
    settings: RegistrySettings,
    base: BaseModelIdentity,
    barrier: CatalogBarrier,
    sources: Sources,
    fleet: FleetRanks,
    tasks: set[asyncio.Task],
    mirrors: list["Followed"],
    resolve: Resolver = system_resolve,
) -> Registry:
    """Open every bucket, follow the catalog and trusted keys (watch tasks added to ``tasks``, the
    mirrors to ``mirrors``), and return the registry once both are loaded."""
    js = nc.jetstream()
    kv = await RecordsKV.open(js)

    async def publish(subject: str, message: BaseModel) -> None:
        await js.publish(subject, encode(message))

    registry = Registry(
        catalog=Catalog(),
        signers={},
        kv=kv,
        approved=await open_approved_store(js, settings.store_dir),
        uploads=Uploads(await open_object_store(js, subjects.ADAPTER_UPLOADS_BUCKET)),
        base=base,
        policy=IntakePolicy(
            limits=AdapterLimits(max_rank=settings.max_rank, max_weights_bytes=settings.max_adapter_bytes),
            dev_mode=settings.dev_mode,
            slot_element_bytes=DTYPE_BYTES[settings.fleet_slot_dtype],
        ),
        trusted_dirs=tuple(Path(d) for d in settings.trusted_source_dirs),
        remote=RemoteIntake(settings.remote, sources, RemoteFetcher(settings.remote, resolve)),
        publish=publish,
        audit=functools.partial(publish_registry_audit, js),
        fleet=fleet.current,
        gate=GatePolicy(
            require_eval=settings.release_require_eval,
            min_score=settings.release_min_score,
            max_regression=settings.release_max_regression,
        ),
        sync_views=barrier.wait,
        askers=lambda tenant, base_model: asker(nc, tenant, base_model, settings.release_eval_timeout_s),
    )
    # the catalog and the signers follow their buckets: every replica's writes, not this one's alone
    mirrors.append(await follow_loaded(nc, subjects.REGISTRY_RECORDS_BUCKET, registry.apply_entry, tasks))
    mirrors.append(await follow_loaded(nc, subjects.REGISTRY_SIGNERS_BUCKET, registry.signer_ops.apply_signer, tasks))
    return registry


@dataclass(frozen=True, slots=True)
class Followed:
    """A bucket this replica mirrors in memory, and how far the mirror has applied it."""

    bucket: KeyValue
    position: Position


async def follow_loaded(nc: NATS, bucket: str, apply: Apply, tasks: set[asyncio.Task]) -> Followed:
    """Follow ``bucket`` into ``apply`` (a task added to ``tasks``), returning once its values are in."""
    loaded, position = asyncio.Event(), Position(bucket)
    task = asyncio.create_task(follow_bucket(nc, bucket, position.tracking(apply), loaded.set))
    tasks.add(task)
    waiting = asyncio.create_task(loaded.wait())
    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if task.done():
        task.result()  # raises what stopped the watch
    return Followed(await nc.jetstream().key_value(bucket), position)


def read_your_writes(
    mirrors: list[Followed], handler: Callable[[M], Awaitable[BaseModel]]
) -> Callable[[M], Awaitable[BaseModel]]:
    """``handler`` once every mirror holds what its bucket held when the request came: a write made
    through another replica (a tenant created there, then its key asked for here) is seen here."""

    async def after_barrier(request: M) -> BaseModel:
        try:
            await asyncio.gather(*(m.position.caught_up(m.bucket) for m in mirrors))
        except StaleMirror as e:
            raise ServiceUnavailable(
                f"this registry replica is behind its state ({e}); retry", retry_after_s=1.0
            ) from None
        return await handler(request)

    return after_barrier


def _op(request_type: type[M], handler: Callable[[M], Awaitable[BaseModel]]) -> Handler:
    """One op's request model and handler, checked to fit each other."""
    return request_type, handler


async def subscribe(
    nc: NATS,
    registry: Registry,
    tenants: Tenants,
    sources: Sources,
    releases: ReleaseController,
    pins: Pins,
    routing: Routing,
    experiments: Experiments,
    mirrors: list[Followed],
) -> list[Subscription]:
    """One typed request-reply handler per op on ``lf.registry.<op>``, in the ``registry`` queue group:
    each request reaches one of the running replicas, and is handled once that replica's mirrors
    hold every write acknowledged before it came (``read_your_writes``)."""
    handlers: dict[str, Handler] = {
        "resolve": _op(ResolveRequest, registry.resolve),
        "list": _op(ListModelsRequest, registry.list_models),
        "register": _op(RegisterRequest, registry.register),
        "promote": _op(PromoteRequest, registry.promote),
        "rollout": _op(RolloutRequest, registry.rollout),
        "rollback": _op(RollbackRequest, registry.rollback),
        "retire": _op(RetireRequest, registry.retire),
        "revoke": _op(RevokeRequest, registry.revoke),
        "get": _op(GetAdapterRequest, registry.get),
        "adapters": _op(ListAdaptersRequest, registry.adapters),
        "trust_key": _op(TrustKeyRequest, registry.signer_ops.trust_key),
        "untrust_key": _op(UntrustKeyRequest, registry.signer_ops.untrust_key),
        "keys": _op(ListKeysRequest, registry.signer_ops.keys),
        "record_eval": _op(RecordEvalRequest, registry.record_eval),
        "attach_eval_set": _op(AttachEvalSetRequest, registry.attach_eval_set),
        "tenant_create": _op(CreateTenantRequest, tenants.create_tenant),
        "tenants": _op(ListTenantsRequest, tenants.list_tenants),
        "quota_set": _op(SetQuotaRequest, tenants.set_quota),
        "api_key_create": _op(CreateApiKeyRequest, tenants.create_key),
        "api_key_revoke": _op(RevokeApiKeyRequest, tenants.revoke_key),
        "api_keys": _op(ListApiKeysRequest, tenants.list_keys),
        "source_add": _op(AddSourceRequest, sources.add),
        "source_remove": _op(RemoveSourceRequest, sources.remove),
        "source_approve": _op(ApproveSourceRequest, sources.approve),
        "sources": _op(ListSourcesRequest, sources.list_sources),
        "release_start": _op(ReleaseStartRequest, releases.start),
        "release_status": _op(ReleaseStatusRequest, releases.status),
        "pin": _op(PinRequest, pins.pin),
        "unpin": _op(PinRequest, pins.unpin),
        "pins": _op(ListPinsRequest, pins.list_pins),
        "routes_set": _op(SetRoutesRequest, routing.set_routes),
        "routes_delete": _op(DeleteRoutesRequest, routing.delete_routes),
        "routes": _op(GetRoutesRequest, routing.routes),
        "policies_set": _op(SetPoliciesRequest, routing.set_policies),
        "policies": _op(GetPoliciesRequest, routing.policies),
        "experiment_create": _op(CreateExperimentRequest, experiments.create),
        "experiment_state": _op(ExperimentStateRequest, experiments.set_state),
        "experiments": _op(ListExperimentsRequest, experiments.list_experiments),
        "experiment_status": _op(GetExperimentRequest, experiments.status),
    }
    assert set(handlers) == set(subjects.REGISTRY_OPS)
    # a register from a remote source spends its fetch outside the registry's lock, a promote or a
    # release start its eval set's run on a worker: run each in its own task, so one slow source or
    # eval does not hold up the ops behind it
    return [
        await serve(
            nc,
            subjects.registry(op),
            model,
            read_your_writes(mirrors, handler),
            queue=QUEUE,
            concurrent=op in ("register", "promote", "release_start"),
        )
        for op, (model, handler) in handlers.items()
    ]


@dataclass(eq=False)
class RegistryService:
    """What this replica learns from the bus besides its ops: each message is one call of a named handler."""

    nc: NATS
    barrier: CatalogBarrier  # which services' catalog views a change waits for
    fleet: FleetRanks  # the rank classes a push must fit
    slots: FleetSlots  # the slots pins must fit

    async def subscribe(self) -> None:
        await self.nc.subscribe(subjects.SERVICE_HEARTBEAT_ALL, cb=self.on_heartbeat)
        await self.nc.subscribe(subjects.WORKER_HEARTBEAT, cb=self.on_worker_heartbeat)

    async def on_heartbeat(self, msg: Msg) -> None:
        try:
            self.barrier.on_heartbeat(decode(ServiceHeartbeat, msg.data))
        except LorafleetError as e:
            log.warning("bad_heartbeat", error=e.message)

    async def on_worker_heartbeat(self, msg: Msg) -> None:
        try:
            beat = decode(WorkerHeartbeat, msg.data)
            self.fleet.heartbeat(beat)
            self.slots.on_heartbeat(beat)
        except LorafleetError as e:
            log.warning("bad_worker_heartbeat", error=e.message)


async def start_experiments(
    nc: NATS, registry: Registry, barrier: CatalogBarrier, watches: set[asyncio.Task], mirrors: list[Followed]
) -> Experiments:
    """The experiment ops, over a mirror of the routing bucket (in ``mirrors``: read-your-writes),
    their figures fed by the completion and feedback records since the oldest experiment began."""
    routes, stats = Routes(), ExperimentStats()
    mirrors.append(await follow_loaded(nc, subjects.REGISTRY_ROUTING_BUCKET, routes.apply, watches))
    since = min((e.started_at for e in routes.experiments.values()), default=time.time())
    for subject in (subjects.AUDIT_COMPLETION_ALL, subjects.AUDIT_FEEDBACK_ALL):
        await follow_since(nc.jetstream(), subject, since, stats)
    return await open_experiments(nc.jetstream(), registry.catalog, routes, stats, barrier.wait)


async def run(settings: RegistrySettings, stop: asyncio.Event, resolve: Resolver = system_resolve) -> None:
    """Serve until ``stop`` is set, then drain. ``resolve`` is how remote source hosts are looked up."""
    base = await asyncio.to_thread(base_model_identity, settings)
    async with AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"registry-{settings.instance_id}")
        stack.push_async_callback(drain_or_close, nc)
        barrier = CatalogBarrier(nc, settings.liveness_timeout_s, settings.gateway_sync_timeout_s)
        fleet = FleetRanks(base.name, settings.fleet_rank_classes, settings.liveness_timeout_s)
        service = RegistryService(nc, barrier, fleet, FleetSlots(settings.liveness_timeout_s))
        await service.subscribe()
        await ensure_streams(nc.jetstream())
        sources = await open_sources(nc.jetstream())
        watches: set[asyncio.Task] = set()
        stack.push_async_callback(lambda: event_loop.cancel_all(list(watches)))
        mirrors: list[Followed] = []
        registry = await open_registry(nc, settings, base, barrier, sources, fleet, watches, mirrors, resolve)
        gc.freeze()  # the loaded catalog is long-lived: keep full collections from rescanning it per request
        stack.callback(gc.unfreeze)
        releases = await start_controller(nc, settings, registry)
        tenants = await open_tenants(nc.jetstream())
        # other replicas' changes
        mirrors.append(await follow_loaded(nc, subjects.REGISTRY_TENANTS_BUCKET, tenants.apply, watches))
        slot_quota = functools.partial(tenants.slot_quota, default=settings.default_quota.max_gpu_adapter_slots)
        pins = await open_pins(nc.jetstream(), registry.catalog, service.slots, slot_quota)
        routing = await open_routing(nc.jetstream(), registry.catalog, barrier.wait)
        experiments = await start_experiments(nc, registry, barrier, watches, mirrors)
        await subscribe(nc, registry, tenants, sources, releases, pins, routing, experiments, mirrors)
        ticks = asyncio.create_task(drive_releases(releases, settings.release_tick_s))
        stack.push_async_callback(event_loop.cancel_all, [ticks])
        metrics_port = stack.enter_context(
            serve_metrics(settings.metrics_port, settings.metrics_host, settings.metrics_bearer())
        ).port
        beat = asyncio.create_task(
            publish_heartbeats(
                nc,
                "registry",
                settings.instance_id,
                settings.heartbeat_interval_s,
                lambda: (True, f"{len(registry.catalog)} adapter versions"),
                metrics_port,
                checks_off(settings),
            )
        )
        stack.push_async_callback(event_loop.cancel_all, [beat])
        log.info("registry_ready", base_model=base.name, fingerprint=base.fingerprint, versions=len(registry.catalog))
        await stop.wait()


async def _serve(settings: RegistrySettings) -> None:
    configure_logging("registry", settings.log_level)
    setup_tracing("registry", settings.trace_exporter)
    await run(settings, shutdown_event())


def main() -> None:
    event_loop.run(_serve(load_settings(RegistrySettings, sys.argv[1:])))
