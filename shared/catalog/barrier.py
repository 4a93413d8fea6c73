"""Read-your-writes for every ``CatalogView``: a catalog write returns once every live gateway,
scheduler and worker confirms its view holds the write's revision of the records bucket (or
after a bound). The registry waits (``CatalogBarrier``), counting the views by their services'
heartbeats; each view answers (``answer_barrier``)."""

import asyncio
from typing import Protocol

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared import metrics, subjects
from shared.bus import decode, encode
from shared.errors import LorafleetError
from shared.liveness import Liveness
from shared.schemas import CatalogSync, CatalogSynced, ServiceHeartbeat

log = structlog.get_logger("catalog.barrier")

# whose mirrors resolve requests: the gateway (HTTP), the scheduler (direct-NATS submissions) and the
# worker (its own check of each dispatch). A scheduler or worker counts once ready: a worker heartbeats
# while it loads its base model, before it follows the catalog.
MIRRORS = ("gateway", "scheduler", "worker")


def mirror_name(service: str, instance_id: str) -> str:
    return f"{service}/{instance_id}"  # instance ids are unique per service only


class View(Protocol):
    """What answers the barrier: a ``CatalogView`` (the records-bucket revision it holds)."""

    revision: int

    async def caught_up(self, revision: int, timeout_s: float) -> bool: ...

    async def routing_caught_up(self, revision: int, timeout_s: float) -> bool: ...


class CatalogBarrier:
    def __init__(self, nc: NATS, liveness_timeout_s: float, timeout_s: float) -> None:
        self._nc = nc
        self._mirrors: Liveness[None] = Liveness(liveness_timeout_s)
        self._timeout_s = timeout_s

    def on_heartbeat(self, beat: ServiceHeartbeat) -> None:
        if beat.service == "gateway" or (beat.service in MIRRORS and beat.ready):
            self._mirrors.seen(mirror_name(beat.service, beat.instance_id), None)

    async def wait(self, revision: int, routing_revision: int = 0) -> set[str]:
        """The live mirrors (``service/instance``) that did not confirm ``revision`` of the records
        bucket (and ``routing_revision`` of the routing bucket) in time (empty: every one did)."""
        pending = set(self._mirrors.alive())
        if not pending or self._timeout_s == 0:
            return set()
        all_confirmed = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Msg) -> None:
            try:
                reply = decode(CatalogSynced, msg.data)
            except LorafleetError:
                return
            if reply.revision >= revision:
                pending.discard(mirror_name(reply.service, reply.instance_id))
            if not pending and not all_confirmed.done():
                all_confirmed.set_result(None)

        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, cb=on_reply)
        try:
            sync = CatalogSync(revision=revision, routing_revision=routing_revision)
            await self._nc.publish(subjects.GATEWAY_CATALOG_SYNC, encode(sync), reply=inbox)
            await asyncio.wait_for(all_confirmed, self._timeout_s)
        except TimeoutError:
            metrics.GATEWAY_SYNC_TIMEOUTS.inc()
            log.warning("catalog_sync_timeout", revision=revision, mirrors=sorted(pending))
        finally:
            await sub.unsubscribe()
        return set(pending)


async def answer_barrier(nc: NATS, service: str, instance_id: str, view: View, timeout_s: float) -> None:
    """Answer the registry's barrier after each catalog write once ``view`` holds the write's
    revision (waiting up to ``timeout_s``), so that a promote, rollback or revoke returns only
    when this instance resolves with it."""

    async def on_sync(msg: Msg) -> None:
        try:
            wanted = decode(CatalogSync, msg.data)
        except LorafleetError as e:
            log.warning("bad_catalog_sync", error=e.message)
            return
        held = await view.caught_up(wanted.revision, timeout_s)
        if held and await view.routing_caught_up(wanted.routing_revision, timeout_s) and msg.reply:
            synced = CatalogSynced(service=service, instance_id=instance_id, revision=view.revision)
            await nc.publish(msg.reply, encode(synced))

    await nc.subscribe(subjects.GATEWAY_CATALOG_SYNC, cb=on_sync)
