"""Read-your-writes for every catalog mirror: a catalog write returns once every live gateway,
scheduler and worker confirms its mirror holds the write's revision of the records bucket (or
after a bound). The registry counts them by their service heartbeats."""

import asyncio

import structlog
from nats.aio.client import Client as NATS

from shared import metrics, subjects
from shared.bus import decode, encode
from shared.errors import LorafleetError
from shared.liveness import Liveness
from shared.schemas import CatalogSync, CatalogSynced, ServiceHeartbeat

log = structlog.get_logger("registry.gateway_sync")

# whose mirrors resolve requests: the gateway (HTTP), the scheduler (direct-NATS submissions) and the
# worker (its own check of each dispatch). A scheduler or worker counts once ready: a worker heartbeats
# while it loads its base model, before it follows the catalog.
MIRRORS = ("gateway", "scheduler", "worker")


def mirror_name(service: str, instance_id: str) -> str:
    return f"{service}/{instance_id}"  # instance ids are unique per service only


class GatewaySync:
    def __init__(self, nc: NATS, liveness_timeout_s: float, timeout_s: float) -> None:
        self._nc = nc
        self._mirrors: Liveness[None] = Liveness(liveness_timeout_s)
        self._timeout_s = timeout_s

    def on_heartbeat(self, beat: ServiceHeartbeat) -> None:
        if beat.service == "gateway" or (beat.service in MIRRORS and beat.ready):
            self._mirrors.seen(mirror_name(beat.service, beat.instance_id), None)

    async def wait(self, revision: int) -> set[str]:
        """The live mirrors (``service/instance``) that did not confirm ``revision`` in time
        (empty: every one did)."""
        pending = set(self._mirrors.alive())
        if not pending or self._timeout_s == 0:
            return set()
        all_confirmed = asyncio.get_running_loop().create_future()

        async def on_reply(msg) -> None:
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
            await self._nc.publish(subjects.GATEWAY_CATALOG_SYNC, encode(CatalogSync(revision=revision)), reply=inbox)
            await asyncio.wait_for(all_confirmed, self._timeout_s)
        except TimeoutError:
            metrics.GATEWAY_SYNC_TIMEOUTS.inc()
            log.warning("catalog_sync_timeout", revision=revision, mirrors=sorted(pending))
        finally:
            await sub.unsubscribe()
        return set(pending)
