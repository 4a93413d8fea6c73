"""Wire the gateway's catalog mirror to NATS: the shared records-bucket follower and registry
fallback, and its answer to the registry's ``catalog.sync`` barrier (``shared.catalog_follow``)."""

import asyncio

from nats.aio.client import Client as NATS

from shared.catalog_follow import answer_catalog_sync, follow_catalog
from shared.catalog_mirror import CatalogMirror, Resolver


async def start_resolver(
    nc: NATS, instance_id: str, registry_timeout_s: float, mirror: CatalogMirror | None = None
) -> tuple[Resolver, asyncio.Task]:
    """The gateway's Resolver and the task that keeps its mirror current (cancel it to stop)."""
    resolver, watch = follow_catalog(nc, registry_timeout_s, mirror)
    await answer_catalog_sync(nc, "gateway", instance_id, resolver.mirror, registry_timeout_s)
    return resolver, watch
