"""A request is served what its ``model`` resolves to, exactly as the gateway resolves it: the
scheduler checks every submission with ``Grants`` before it is queued, and each worker checks
every dispatch again before it loads or runs anything (the same release and access rules, on
its own mirror).

The scheduler resolves every submission's ``model`` (alias, ``@version``, canary split by request
key, access judged on the version served, release status) with the same code and the same kind of
catalog mirror as the gateway, so a direct-NATS client names a model as an HTTP client does and
needs no adapter block. A block the client did write must be exactly that resolution: the
gateway's own always is. A mirror may lag the registry by a watch delivery, so a disagreement is
settled by the registry's answer before a submission is refused."""

from collections.abc import Awaitable, Callable

from shared.catalog.access import may_use
from shared.catalog.policy import RequestFacts
from shared.catalog.records import Catalog
from shared.catalog.resolve import not_found
from shared.catalog.routing import Routed
from shared.errors import Forbidden, IntegrityError, InvalidRequest, ModelNotFound
from shared.schemas import InferRequest, ResolveReply, ResolveRequest

Resolve = Callable[[ResolveRequest, bool], Awaitable[ResolveReply]]  # (request, ask_registry)
# (tenant, model, task header, facts, base model)
Route = Callable[[str, str | None, str | None, RequestFacts, str | None], Routed]


def _no_routes(tenant_id: str, model: str | None, task: str | None, facts: RequestFacts, base: str | None) -> Routed:
    return Routed(model or "")


def facts_of(request: InferRequest, tier: str | None) -> RequestFacts:
    """What a policy matches in a submission: ``route_facts`` as the gateway wrote them (the
    scheduler clears them on a tenant's own subject, so a direct client claims no key or header)."""
    written = request.route_facts
    return RequestFacts(
        tier=tier,
        key_id=written.key_id if written else None,
        model=request.model,
        metadata=request.metadata,
        headers=written.headers if written else {},
        request_key=request.request_key or request.request_id,
    )


class IsolationAttempt(Forbidden):
    """A tenant named another tenant's adapter. Audited under this code; the client gets ``answer``,
    the same model_not_found as for a missing adapter, so it learns nothing."""

    code = "tenant_isolation_attempt"

    def __init__(self, message: str, answer: ModelNotFound):
        super().__init__(message)
        self.answer = answer


class Grants:
    def __init__(self, resolve: Resolve, catalog: Catalog | None = None, route: Route = _no_routes):
        self._resolve = resolve
        self._route = route
        # the mirror's (empty until loaded, so never ``or``-ed away), to tell a foreign adapter block apart
        self._catalog = catalog if catalog is not None else Catalog()

    async def grant(self, request: InferRequest, preview: bool, tier: str | None = None) -> InferRequest:
        """The request with the adapter its ``model`` resolves to (after its task route or policy
        rule, the same step the gateway took), or a typed refusal. ``preview``: it came on the
        gateway's preview subject, where a pinned staging version may be served. The granted
        request names the routed model and task: a worker's check resolves it as it stands."""
        routed = self._route(
            request.tenant_id, request.model, request.task, facts_of(request, tier), request.base_model
        )
        if routed.model != request.model or routed.task != request.task or routed.experiment is not None:
            update = {"model": routed.model, "task": routed.task, "experiment": routed.experiment, "arm": routed.arm}
            request = request.model_copy(update=update)
        if request.model == request.base_model and request.adapter is None:
            return request
        self._refuse_foreign_block(request)
        asked = ResolveRequest(
            tenant_id=request.tenant_id,
            model=request.model,
            request_key=request.request_key or request.request_id,
            preview=preview,
        )
        reply = await self._resolve(asked, False)
        if not self._agrees(request, reply):
            reply = await self._resolve(asked, True)
        if reply.base_model != request.base_model:
            raise InvalidRequest(
                f"'{request.model}' runs on {reply.base_model}, not {request.base_model}", param="base_model"
            )
        if not self._agrees(request, reply):
            raise IntegrityError(f"the request's adapter is not the version '{request.model}' resolves to")
        return request.model_copy(update={"adapter": reply.adapter})

    @staticmethod
    def _agrees(request: InferRequest, reply: ResolveReply) -> bool:
        written = request.adapter
        return reply.base_model == request.base_model and (written is None or written == reply.adapter)

    def _refuse_foreign_block(self, request: InferRequest) -> None:
        """A block naming a version of another tenant's adapter is an isolation attempt (audited)."""
        written = request.adapter
        if written is None:
            return
        record = self._catalog.get(written.adapter_id, written.version) or self._catalog.latest(written.adapter_id)
        if record is not None and not may_use(record, request.tenant_id):
            raise IsolationAttempt(
                f"tenant {request.tenant_id} submitted {written.adapter_id} v{written.version} of another tenant",
                not_found(request.model),
            )
