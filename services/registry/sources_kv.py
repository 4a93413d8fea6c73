"""Open the ``lf_sources`` KV bucket and build the Sources ops on it, their changes audited on the
AUDIT stream."""

from nats.js import JetStreamContext

from services.registry.kv import AuditedBucket
from services.registry.sources import Sources
from shared import subjects


async def open_sources(js: JetStreamContext) -> Sources:
    b = await AuditedBucket.open(js, subjects.REGISTRY_SOURCES_BUCKET)
    return Sources(b.load, b.put, b.delete, b.audit)
