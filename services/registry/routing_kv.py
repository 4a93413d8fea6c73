"""Open the ``lf_routing`` KV bucket and build the Routing ops on it: compare-and-set writes, audited."""

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.registry.kv import AuditedBucket
from services.registry.routing import Routing, SyncViews
from shared import subjects
from shared.catalog.records import Catalog
from shared.errors import Conflict


async def open_routing(js: JetStreamContext, catalog: Catalog, sync_views: SyncViews) -> Routing:
    b = await AuditedBucket.open(js, subjects.REGISTRY_ROUTING_BUCKET)

    async def read(key: str) -> tuple[bytes | None, int]:
        try:
            entry = await b.bucket.get(key)
        except KeyNotFoundError:  # absent, or deleted: ``create`` writes over a tombstone
            return None, 0
        return entry.value, entry.revision or 0

    async def write(key: str, value: bytes, revision: int) -> int:
        try:
            if revision == 0:
                return await b.bucket.create(key, value)
            return await b.bucket.update(key, value, last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(f"{key} was changed by another registry replica meanwhile; retry") from None

    return Routing(catalog, read, write, b.audit, sync_views)
