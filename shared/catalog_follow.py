"""A catalog mirror kept current from the registry's records bucket, and the Resolver over it
that falls back to the registry's resolve: what the gateway and the scheduler both resolve with."""

import asyncio

from nats.aio.client import Client as NATS

from shared import subjects
from shared.bus import request
from shared.catalog_mirror import CatalogMirror, Resolver
from shared.kv_follow import follow_bucket
from shared.schemas import ResolveReply, ResolveRequest


def follow_catalog(
    nc: NATS, registry_timeout_s: float, mirror: CatalogMirror | None = None
) -> tuple[Resolver, asyncio.Task[None]]:
    """The Resolver and the task that keeps its mirror current (cancel it to stop)."""
    mirror = mirror or CatalogMirror()
    watch = asyncio.create_task(follow_bucket(nc, subjects.REGISTRY_RECORDS_BUCKET, mirror.apply, mirror.mark_loaded))

    async def ask_registry(req: ResolveRequest) -> ResolveReply:
        return await request(nc, subjects.registry("resolve"), req, ResolveReply, registry_timeout_s)

    return Resolver(mirror, ask_registry), watch
