"""Open the ``lf_sources`` KV bucket and build the Sources ops on it, their changes audited on the
AUDIT stream."""

import uuid

from nats.js import JetStreamContext

from services.registry.kv import load_all, open_bucket
from services.registry.sources import Sources
from shared import subjects
from shared.audit_publish import publish_audit
from shared.errors import ServiceUnavailable
from shared.schemas import AdminAudit


async def open_sources(js: JetStreamContext) -> Sources:
    bucket = await open_bucket(js, subjects.REGISTRY_SOURCES_BUCKET)

    async def load() -> dict[str, bytes]:
        return await load_all(bucket)

    async def put(key: str, value: bytes) -> None:
        await bucket.put(key, value)

    async def delete(key: str) -> None:
        await bucket.delete(key)

    async def audit(event: AdminAudit) -> None:
        if not await publish_audit(js, event, f"admin.{uuid.uuid4().hex}"):
            raise ServiceUnavailable(f"{event.action} of {event.target} is stored, but its audit record is not yet")

    return Sources(load, put, delete, audit)
