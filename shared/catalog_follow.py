"""A catalog mirror kept current from the registry's records bucket, and the Resolver over it
that falls back to the registry's resolve: what the gateway, the scheduler and the worker resolve
with; and each mirror's answer to the registry's ``catalog.sync`` barrier (read-your-writes)."""

import asyncio

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import subjects
from shared.bus import decode, encode, request
from shared.catalog_mirror import CatalogMirror, Resolver
from shared.errors import LorafleetError
from shared.kv_follow import follow_bucket
from shared.schemas import CatalogSync, CatalogSynced, ResolveReply, ResolveRequest

log = structlog.get_logger("catalog")


def follow_catalog(
    nc: NATS, registry_timeout_s: float, mirror: CatalogMirror | None = None
) -> tuple[Resolver, asyncio.Task[None]]:
    """The Resolver and the task that keeps its mirror current (cancel it to stop)."""
    mirror = mirror or CatalogMirror()
    watch = asyncio.create_task(follow_bucket(nc, subjects.REGISTRY_RECORDS_BUCKET, mirror.apply, mirror.mark_loaded))

    async def ask_registry(req: ResolveRequest) -> ResolveReply:
        return await request(nc, subjects.registry("resolve"), req, ResolveReply, registry_timeout_s)

    return Resolver(mirror, ask_registry), watch


async def answer_catalog_sync(
    nc: NATS, service: str, instance_id: str, mirror: CatalogMirror, timeout_s: float
) -> None:
    """Answer the registry's barrier after each catalog write once ``mirror`` holds the write's
    revision (waiting up to ``timeout_s``), so that a promote, rollback or revoke returns only
    when this instance resolves with it."""

    async def on_sync(msg: Msg) -> None:
        try:
            wanted = decode(CatalogSync, msg.data).revision
        except LorafleetError as e:
            log.warning("bad_catalog_sync", error=e.message)
            return
        if await mirror.caught_up(wanted, timeout_s) and msg.reply:
            synced = CatalogSynced(service=service, instance_id=instance_id, revision=mirror.revision)
            await nc.publish(msg.reply, encode(synced))

    await nc.subscribe(subjects.GATEWAY_CATALOG_SYNC, cb=on_sync)
