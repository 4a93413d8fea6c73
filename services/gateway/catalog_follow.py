"""Wire the gateway's catalog mirror to NATS: the records-bucket watch that feeds it, the answer
to the registry's ``catalog.sync`` barrier, and the registry resolve the Resolver falls back to."""

import asyncio

import structlog
from nats.aio.client import Client as NATS

from services.gateway.catalog_mirror import CatalogMirror, Resolver
from shared import subjects
from shared.bus import decode, encode, request
from shared.errors import LorafleetError
from shared.kv_follow import follow_bucket
from shared.schemas import CatalogSync, CatalogSynced, ResolveReply, ResolveRequest

log = structlog.get_logger("gateway.catalog")


async def start_resolver(
    nc: NATS, instance_id: str, registry_timeout_s: float, mirror: CatalogMirror | None = None
) -> tuple[Resolver, asyncio.Task]:
    """The gateway's Resolver and the task that keeps its mirror current (cancel it to stop)."""
    mirror = mirror or CatalogMirror()
    watch = asyncio.create_task(follow_bucket(nc, subjects.REGISTRY_RECORDS_BUCKET, mirror.apply, mirror.mark_loaded))

    async def on_sync(msg) -> None:
        try:
            wanted = decode(CatalogSync, msg.data).revision
        except LorafleetError as e:
            log.warning("bad_catalog_sync", error=e.message)
            return
        if await mirror.caught_up(wanted, registry_timeout_s) and msg.reply:
            await nc.publish(msg.reply, encode(CatalogSynced(instance_id=instance_id, revision=mirror.revision)))

    await nc.subscribe(subjects.GATEWAY_CATALOG_SYNC, cb=on_sync)

    async def ask_registry(req: ResolveRequest) -> ResolveReply:
        return await request(nc, subjects.registry("resolve"), req, ResolveReply, registry_timeout_s)

    return Resolver(mirror, ask_registry), watch
