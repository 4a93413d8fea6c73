"""Open the ``lf_tenants`` KV bucket and build the Tenants ops from its contents, their changes
audited on the AUDIT stream."""

import uuid

from nats.js import JetStreamContext

from services.registry.kv import load_all, open_bucket
from services.registry.tenants import Tenants
from shared import subjects
from shared.audit_publish import publish_audit
from shared.errors import ServiceUnavailable
from shared.schemas import AdminAudit


async def open_tenants(js: JetStreamContext) -> Tenants:
    bucket = await open_bucket(js, subjects.REGISTRY_TENANTS_BUCKET)

    async def put(key: str, value: bytes) -> None:
        await bucket.put(key, value)

    async def audit(event: AdminAudit) -> None:
        if not await publish_audit(js, event, f"admin.{uuid.uuid4().hex}"):
            raise ServiceUnavailable(f"{event.action} of {event.target} is stored, but its audit record is not yet")

    return Tenants(await load_all(bucket), put, audit)
