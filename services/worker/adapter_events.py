"""React to registry lifecycle events: a revoked version leaves every tier at once and its
running requests stop; a rolled-back or retired version leaves the idle tiers."""

import structlog

from services.worker.adapter_cache.hierarchy import CacheHierarchy
from services.worker.serving import RequestServer
from shared.errors import AdapterRevoked
from shared.schemas import AdapterEvent

log = structlog.get_logger("worker.events")

EVICTING = {"revoked", "rolled_back", "retired"}


def on_adapter_event(event: AdapterEvent, cache: CacheHierarchy, server: RequestServer) -> list[str]:
    """Apply one event; the cache keys it removed."""
    if event.kind not in EVICTING:
        return []
    if event.kind == "rolled_back" and event.status in ("production", "canary"):
        return []  # the version rolled back *to* keeps serving
    keys = cache.invalidate(event.adapter_id, event.version)
    stopped = 0
    if event.kind == "revoked":
        stopped = server.cancel_adapter(
            keys, AdapterRevoked(f"adapter {event.adapter_id} v{event.version} was revoked while this request ran")
        )
    log.info(
        "adapter_invalidated",
        kind=event.kind,
        adapter_id=event.adapter_id,
        version=event.version,
        keys=keys,
        requests_stopped=stopped,
    )
    return keys
