"""Open the ``lf_routing`` KV bucket and build the Routing and Experiments ops on it: compare-and-set
writes, audited."""

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.registry.experiment_stats import ExperimentStats
from services.registry.experiments import Experiments
from services.registry.kv import AuditedBucket
from services.registry.routing import Read, Routing, SyncViews, Write
from shared import subjects
from shared.catalog.records import Catalog
from shared.catalog.routing import Routes
from shared.errors import Conflict


def _ops(b: AuditedBucket) -> tuple[Read, Write]:
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

    return read, write


async def open_routing(js: JetStreamContext, catalog: Catalog, sync_views: SyncViews) -> Routing:
    b = await AuditedBucket.open(js, subjects.REGISTRY_ROUTING_BUCKET)
    return Routing(catalog, *_ops(b), b.audit, sync_views)


async def open_experiments(
    js: JetStreamContext, catalog: Catalog, routes: Routes, stats: ExperimentStats, sync_views: SyncViews
) -> Experiments:
    """``routes``: this replica's mirror of the bucket (the experiments it lists)."""
    b = await AuditedBucket.open(js, subjects.REGISTRY_ROUTING_BUCKET)
    read, write = _ops(b)
    return Experiments(catalog, routes, stats, read, write, b.audit, sync_views)
