"""Wire the gateway's catalog mirror to NATS: the shared records-bucket follower and registry
fallback (``shared.catalog_follow``), plus the answer to the registry's ``catalog.sync`` barrier."""

import asyncio

import structlog
from nats.aio.client import Client as NATS

from shared import subjects
from shared.bus import decode, encode
from shared.catalog_follow import follow_catalog
from shared.catalog_mirror import CatalogMirror, Resolver
from shared.errors import LorafleetError
from shared.schemas import CatalogSync, CatalogSynced

log = structlog.get_logger("gateway.catalog")


async def start_resolver(
    nc: NATS, instance_id: str, registry_timeout_s: float, mirror: CatalogMirror | None = None
) -> tuple[Resolver, asyncio.Task]:
    """The gateway's Resolver and the task that keeps its mirror current (cancel it to stop)."""
    resolver, watch = follow_catalog(nc, registry_timeout_s, mirror)
    mirror = resolver.mirror

    async def on_sync(msg) -> None:
        try:
            wanted = decode(CatalogSync, msg.data).revision
        except LorafleetError as e:
            log.warning("bad_catalog_sync", error=e.message)
            return
        if await mirror.caught_up(wanted, registry_timeout_s) and msg.reply:
            await nc.publish(msg.reply, encode(CatalogSynced(instance_id=instance_id, revision=mirror.revision)))

    await nc.subscribe(subjects.GATEWAY_CATALOG_SYNC, cb=on_sync)
    return resolver, watch
