"""``CatalogView``: the registry's state as every other service reads it, from one KV follower.

The gateway, the scheduler, the worker and the auditor each keep one view, fed by a watch on the
registry's records bucket (and, for a worker, its signers bucket) through ``shared.kv_follow``.
Every change is written to that bucket before the registry applies it, so the view equals the
registry's own catalog within a watch delivery, and a request is resolved in microseconds
instead of a registry round trip (~1.5 ms on the request's path to its first token).

Reads:
- ``resolve``: (tenant, model) -> base model or exact adapter version. Only successes are answered
  locally: any refusal (unknown, foreign, unreleased, revoked) is asked of the registry, which holds
  the newest state and audits an attempt on another tenant's adapter.
- ``grant``: a submission with the adapter its ``model`` resolves to (``shared.catalog.grants``).
- ``record``: one version's record, from the view, else from the bucket itself (never a registry
  replica, dead or stalled).
- ``signers``: the trusted signers' keys, after a read barrier on their bucket.
- ``route``: (tenant, model or task, request facts) -> the model to resolve, by the tenant's task
  routes and the routing policies (``shared.catalog.routing``), for a view that follows ``lf_routing``.

The registry's writes wait for every live mirror to confirm them (``shared.catalog.barrier``), so
once a promote, rollback or revoke has returned, no view resolves with the state before it.
"""

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from shared import metrics, subjects
from shared.bus import request
from shared.catalog.barrier import answer_barrier
from shared.catalog.grants import Grants
from shared.catalog.policy import RequestFacts
from shared.catalog.records import Catalog, record_key
from shared.catalog.resolve import list_models, resolve
from shared.catalog.routing import Routed, Routes
from shared.catalog.signers import parse_signer
from shared.errors import LorafleetError, ModelNotFound, ServiceUnavailable
from shared.kv_follow import Position, StaleMirror, follow_bucket
from shared.schemas import AdapterRecord, InferRequest, RequestRoute, ResolveReply, ResolveRequest, SignerRecord

AskRegistry = Callable[[ResolveRequest], Awaitable[ResolveReply]]
TASK_LABELS = 50  # distinct task label values a view's routing metric keeps


async def _no_registry(req: ResolveRequest) -> ResolveReply:
    raise ServiceUnavailable("no registry to resolve the model with")


def ask_registry(nc: NATS, timeout_s: float) -> AskRegistry:
    """The registry's own resolve (``lf.registry.resolve``): what a view asks when it cannot answer."""

    async def ask(req: ResolveRequest) -> ResolveReply:
        return await request(nc, subjects.registry("resolve"), req, ResolveReply, timeout_s)

    return ask


class CatalogView:
    def __init__(self, ask_registry: AskRegistry = _no_registry, route: RequestRoute = "http") -> None:
        self.catalog = Catalog()
        self.loaded = False
        self.revision = 0  # the last records-bucket revision applied
        self.base_model: str | None = None  # learnt from the registry's first answer
        self._ask = ask_registry
        self.route_path = route  # the path this view resolves for: the registry audits a refusal under it
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self.routes = Routes()
        self.routing_position: Position | None = None  # set when the view follows the routing bucket
        self._grants = Grants(self.resolve, self.catalog, self.route)
        self._signers: dict[str, SignerRecord] = {}
        self.signer_position = Position(subjects.REGISTRY_SIGNERS_BUCKET)
        self._task_label = metrics.TopLabels(TASK_LABELS, (metrics.ROUTED_REQUESTS,))
        self._experiment_label = metrics.TopLabels(TASK_LABELS, (metrics.EXPERIMENT_REQUESTS,))

    # --- fed by the follower -------------------------------------------------------------------

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """One watched record. Records are never deleted (a retired version keeps its record)."""
        if value is not None:
            self.catalog.put(AdapterRecord.model_validate_json(value))
        self.revision = max(self.revision, revision)
        self._wake()

    def apply_signer(self, key: str, value: bytes | None, revision: int) -> None:
        if value is None:
            self._signers.pop(key, None)
        else:
            self._signers[key] = parse_signer(key, value)

    def mark_loaded(self) -> None:
        self.loaded = True
        self._wake()

    def _wake(self) -> None:
        if not self.loaded:
            return
        waiting = []
        for revision, future in self._waiters:
            if self.revision >= revision:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((revision, future))
        self._waiters = waiting

    async def routing_caught_up(self, revision: int, timeout_s: float) -> bool:
        """Whether the view holds the routing bucket's ``revision`` (a view that does not follow it:
        a worker's, which checks an already-routed request, always does)."""
        if self.routing_position is None or revision == 0:
            return True
        try:
            await self.routing_position.reached(revision, timeout_s)
            return True
        except StaleMirror:
            return False

    async def caught_up(self, revision: int, timeout_s: float) -> bool:
        """Whether the view holds ``revision`` (waiting up to ``timeout_s`` for the watch to bring it)."""
        if self.loaded and self.revision >= revision:
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((revision, future))
        try:
            await asyncio.wait_for(future, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            self._waiters = [(r, f) for r, f in self._waiters if f is not future]

    # --- reads ---------------------------------------------------------------------------------

    async def resolve(self, req: ResolveRequest, ask_registry: bool = False) -> ResolveReply:
        """From the view when it resolves; the registry's answer for a refusal, or with
        ``ask_registry`` (a view may lag the registry by a watch delivery)."""
        if self.loaded and self.base_model is not None and not ask_registry:
            try:
                reply = resolve(self.catalog, self.base_model, req.tenant_id, req.model, req.request_key, req.preview)
                metrics.GATEWAY_RESOLVES.labels("mirror").inc()
                return reply
            except LorafleetError:
                pass  # the registry answers (and audits) every refusal
        path = self.route_path
        reply = await self._ask(req if req.route == path else req.model_copy(update={"route": path}))
        metrics.GATEWAY_RESOLVES.labels("registry").inc()
        self.base_model = reply.base_model
        return reply

    def route(
        self, tenant_id: str, model: str | None, task: str | None, facts: RequestFacts, base_model: str | None = None
    ) -> Routed:
        """The model this request is resolved as (its task route, the policy rule that matched, or
        its experiment's arm), or a typed refusal; counted by task (the top ``TASK_LABELS``, the rest
        as other) and by experiment arm. A view that does not follow the routing bucket (a worker's)
        checks requests the scheduler routed: as they stand. ``base_model``: the submission's (a
        base arm is served as it), else the view's."""
        if self.routing_position is None:
            return Routed(model or "", task)
        try:
            routed = self.routes.route(
                tenant_id, model, task, facts, lambda: self._visible(tenant_id), base_model or self.base_model
            )
        except LorafleetError as e:
            metrics.ROUTED_REQUESTS.labels(self.route_path, "none", e.code).inc()
            raise
        if routed.task is not None or routed.rule is not None:
            outcome = "rule" if routed.rule is not None else "task"
            metrics.ROUTED_REQUESTS.labels(self.route_path, self._task_label(routed.task or "none"), outcome).inc()
        if routed.experiment is not None and routed.arm is not None:
            experiment = self._experiment_label(f"{tenant_id}/{routed.experiment}")
            metrics.EXPERIMENT_REQUESTS.labels(self.route_path, experiment, routed.arm).inc()
        return routed

    def _visible(self, tenant_id: str) -> list[str]:
        if self.base_model is None:
            return []
        return [m.id for m in list_models(self.catalog, self.base_model, tenant_id, 0).models]

    async def grant(self, request: InferRequest, preview: bool, tier: str | None = None) -> InferRequest:
        """The submission with the adapter its ``model`` resolves to (after its task route or policy
        rule: ``tier`` is its tenant's), or a typed refusal."""
        return await self._grants.grant(request, preview, tier)

    def owner(self, adapter_id: str) -> str | None:
        return self.catalog.owner(adapter_id)

    async def record(self, js: JetStreamContext, adapter_id: str, version: int) -> AdapterRecord:
        """One version's record: the view's, else the records bucket's own (a version registered a
        moment ago may not have reached the watch yet). ``ModelNotFound`` if neither has it."""
        record = self.catalog.get(adapter_id, version)
        if record is not None:
            return record
        bucket = await js.key_value(subjects.REGISTRY_RECORDS_BUCKET)
        try:
            entry = await bucket.get(record_key(adapter_id, version))
        except KeyNotFoundError:
            raise ModelNotFound(f"the registry has no {adapter_id} v{version}") from None
        return AdapterRecord.model_validate_json(entry.value or b"")

    async def signers(self, js: JetStreamContext, timeout_s: float) -> dict[str, list[str]]:
        """Each signer's keys whose signatures still verify (signer -> base64 Ed25519 public keys),
        once the view holds every signer write its bucket had acknowledged when called (a read
        barrier: a signer added or untrusted a moment ago counts). Needs a view that follows the
        signers bucket (``follow_catalog(..., signers=True)``)."""
        # one request: the bucket's stream state (a KeyValue handle would cost a second)
        info = await js.stream_info(f"KV_{subjects.REGISTRY_SIGNERS_BUCKET}")
        try:
            await self.signer_position.reached(info.state.last_seq, timeout_s)
        except StaleMirror as e:
            raise ServiceUnavailable(f"the trusted signers are not current: {e}") from None
        return {s.signer: s.verify_keys() for s in self._signers.values()}


@dataclass
class Followed:
    """A running view: ``view`` and the tasks that keep it current (``stop`` cancels them)."""

    view: CatalogView
    tasks: list[asyncio.Task[None]]

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


async def follow_catalog(
    nc: NATS,
    registry_timeout_s: float,
    *,
    barrier: tuple[str, str] | None = None,
    signers: bool = False,
    routing: bool = False,
    view: CatalogView | None = None,
    route: RequestRoute = "http",
) -> Followed:
    """Start a ``CatalogView`` over NATS: its records follower and registry fallback; with
    ``barrier=(service, instance_id)`` its answer to the registry's read-your-writes barrier; with
    ``signers`` a follower of the signers bucket too; with ``routing`` one of the routing bucket
    (task routes and policies: the gateway's and the scheduler's views). ``view``: one built beforehand (with its own
    registry fallback), to follow. ``route``: the path the view resolves for (its refusals' audits)."""
    view = view or CatalogView(ask_registry(nc, registry_timeout_s), route)
    tasks = [asyncio.create_task(follow_bucket(nc, subjects.REGISTRY_RECORDS_BUCKET, view.apply, view.mark_loaded))]
    if signers:
        apply = view.signer_position.tracking(view.apply_signer)
        tasks.append(asyncio.create_task(follow_bucket(nc, subjects.REGISTRY_SIGNERS_BUCKET, apply, lambda: None)))
    if routing:
        view.routing_position = Position(subjects.REGISTRY_ROUTING_BUCKET)
        apply = view.routing_position.tracking(view.routes.apply)
        tasks.append(asyncio.create_task(follow_bucket(nc, subjects.REGISTRY_ROUTING_BUCKET, apply, lambda: None)))
    if barrier is not None:
        service, instance_id = barrier
        await answer_barrier(nc, service, instance_id, view, registry_timeout_s)
    return Followed(view, tasks)
