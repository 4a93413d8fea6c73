"""A request's routing facts as the gateway sees them: the tenant's tier, the caller's key, the
request's metadata and the ``x-`` headers some routing rule matches. The same facts decide the
route here and, carried on the submission (``InferRequest.route_facts``), in the scheduler."""

from collections.abc import Mapping
from dataclasses import dataclass, replace

from services.gateway.auth import Principal
from services.gateway.context import GatewayContext
from shared.catalog.policy import RequestFacts
from shared.catalog.routing import AUTO, TASK_HEADER, Routed
from shared.schemas import RouteFacts


@dataclass(frozen=True, slots=True)
class RouteAsk:
    """What the gateway routes by, and what it carries to the scheduler."""

    model: str
    task: str | None  # the task header, used with model ``auto``
    facts: RequestFacts
    carried: RouteFacts


def route_ask(
    ctx: GatewayContext, caller: Principal, headers: Mapping[str, str], model: str, metadata: Mapping[str, str]
) -> RouteAsk:
    header = headers.get(TASK_HEADER)
    task = header.strip() if header is not None and model == AUTO else None
    wanted = ctx.catalog.routes.header_names(caller.tenant_id)
    matched = {name: headers[name][:256] for name in sorted(wanted) if headers.get(name)}
    facts = RequestFacts(
        tier=ctx.keys.tier(caller.tenant_id),
        key_id=caller.key_id,
        model=model,
        metadata=dict(metadata),
        headers=matched,
    )
    return RouteAsk(model, task, facts, RouteFacts(key_id=caller.key_id, headers=matched))


def routed(ctx: GatewayContext, tenant_id: str, ask: RouteAsk, request_key: str) -> Routed:
    """The gateway's routing step; ``request_key`` (the ``user``, else the request id) is what an
    experiment splits by, as the scheduler's step does with the submission's."""
    return ctx.catalog.route(tenant_id, ask.model, ask.task, replace(ask.facts, request_key=request_key))
