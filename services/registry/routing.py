"""Task routes and routing policies: the registry ops behind ``lf.registry.routes_set``,
``routes_delete``, ``routes``, ``policies_set`` and ``policies``.

Both live in the KV bucket ``lf_routing`` (keys in ``shared.catalog.routing``). A change is a
compare-and-set against the entry the op read (two replicas never both apply theirs), carries the
next ``revision`` of its table or set, is recorded on the AUDIT stream (``AdminAudit``
``task_routes_set`` / ``task_routes_deleted`` / ``route_policies_set``, the platform's set under the
``shared`` tenant) and returns once every gateway and scheduler view holds it (the catalog barrier).
"""

from collections.abc import Awaitable, Callable
from typing import Literal

from shared.catalog.access import SHARED_TENANT
from shared.catalog.records import Catalog
from shared.catalog.resolve import find_adapter
from shared.catalog.routing import policies_key, tasks_key
from shared.errors import NotFound
from shared.schemas import (
    AdminAudit,
    DeleteRoutesRequest,
    GetPoliciesRequest,
    GetRoutesRequest,
    PoliciesReply,
    RoutePolicies,
    RoutesReply,
    RouteTarget,
    SetPoliciesRequest,
    SetRoutesRequest,
    TaskRoutes,
)

Read = Callable[[str], Awaitable[tuple[bytes | None, int]]]  # key -> (value or None, its revision; 0: absent)
Write = Callable[[str, bytes, int], Awaitable[int]]  # (key, value, expected revision) -> the new revision
Audit = Callable[[AdminAudit], Awaitable[None]]
SyncViews = Callable[[int, int], Awaitable[set[str]]]  # (records revision, routing revision) -> views behind
RoutingAction = Literal["task_routes_set", "task_routes_deleted", "route_policies_set"]


class Routing:
    def __init__(self, catalog: Catalog, read: Read, write: Write, audit: Audit, sync_views: SyncViews) -> None:
        self._catalog = catalog
        self._read, self._write, self._audit, self._sync = read, write, audit, sync_views

    async def set_routes(self, req: SetRoutesRequest) -> RoutesReply:
        for target in req.routes.values():
            self._usable(req.tenant_id, target)
        before, revision = await self._tasks(req.tenant_id)
        table = TaskRoutes(tenant_id=req.tenant_id, routes=req.routes, revision=before.revision + 1,
                           updated_by=req.actor)  # fmt: skip
        await self._store(tasks_key(req.tenant_id), table.model_dump_json().encode(), revision)
        await self._record(req.actor, req.tenant_id, "task_routes_set", table.revision, routes=_dump(table.routes))
        return RoutesReply(routes=table)

    async def delete_routes(self, req: DeleteRoutesRequest) -> RoutesReply:
        before, revision = await self._tasks(req.tenant_id)
        if req.task is not None and req.task not in before.routes:
            raise NotFound(f"tenant {req.tenant_id} has no route for task '{req.task}'", param="task")
        kept = {t: r for t, r in before.routes.items() if req.task is not None and t != req.task}
        table = TaskRoutes(tenant_id=req.tenant_id, routes=kept, revision=before.revision + 1, updated_by=req.actor)
        await self._store(tasks_key(req.tenant_id), table.model_dump_json().encode(), revision)
        await self._record(req.actor, req.tenant_id, "task_routes_deleted", table.revision, task=req.task or "*")
        return RoutesReply(routes=table)

    async def routes(self, req: GetRoutesRequest) -> RoutesReply:
        return RoutesReply(routes=(await self._tasks(req.tenant_id))[0])

    async def set_policies(self, req: SetPoliciesRequest) -> PoliciesReply:
        if req.tenant_id is not None:
            for rule in req.rules:
                if rule.target.adapter is not None:
                    self._usable(req.tenant_id, rule.target.adapter)
        before, revision = await self._policies(req.tenant_id)
        policies = RoutePolicies(tenant_id=req.tenant_id, rules=req.rules, revision=before.revision + 1,
                                 updated_by=req.actor)  # fmt: skip
        await self._store(policies_key(req.tenant_id), policies.model_dump_json().encode(), revision)
        rules = [r.model_dump(mode="json") for r in policies.rules]
        owner = req.tenant_id or SHARED_TENANT
        await self._record(req.actor, owner, "route_policies_set", policies.revision, rules=rules)
        return PoliciesReply(policies=policies)

    async def policies(self, req: GetPoliciesRequest) -> PoliciesReply:
        return PoliciesReply(policies=(await self._policies(req.tenant_id))[0])

    def _usable(self, tenant_id: str, target: RouteTarget) -> None:
        check_usable(self._catalog, tenant_id, target)

    async def _tasks(self, tenant_id: str) -> tuple[TaskRoutes, int]:
        value, revision = await self._read(tasks_key(tenant_id))
        table = TaskRoutes.model_validate_json(value) if value else TaskRoutes(tenant_id=tenant_id, updated_at=0)
        return table, revision

    async def _policies(self, tenant_id: str | None) -> tuple[RoutePolicies, int]:
        value, revision = await self._read(policies_key(tenant_id))
        policies = (
            RoutePolicies.model_validate_json(value) if value else RoutePolicies(tenant_id=tenant_id, updated_at=0)
        )
        return policies, revision

    async def _store(self, key: str, value: bytes, revision: int) -> None:
        written = await self._write(key, value, revision)
        await self._sync(0, written)

    async def _record(self, actor: str, tenant_id: str, action: RoutingAction, revision: int, **detail: object) -> None:
        event = AdminAudit(actor=actor, tenant_id=tenant_id, action=action, target=tenant_id,
                           detail={"revision": revision, **detail})  # fmt: skip
        await self._audit(event)


def check_usable(catalog: Catalog, tenant_id: str, target: RouteTarget) -> None:
    """A route may name only an adapter (and version) the tenant may call: else the same 404 as a missing one."""
    adapter_id = find_adapter(catalog, tenant_id, target.adapter)
    if adapter_id is None or (target.version is not None and catalog.get(adapter_id, target.version) is None):
        raise NotFound(f"adapter '{target.model}' does not exist or you do not have access to it", param="adapter")


def _dump(routes: dict[str, RouteTarget]) -> dict[str, dict]:
    return {task: target.model_dump(mode="json") for task, target in sorted(routes.items())}
