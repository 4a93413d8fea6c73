"""Open the ``lf_pins`` KV bucket and build the Pins ops on it, their changes audited on the AUDIT stream."""

import uuid

from nats.js import JetStreamContext

from services.registry.kv import load_all, open_bucket
from services.registry.pins import FleetSlots, Pins, SlotQuota
from shared import subjects
from shared.audit_publish import publish_audit
from shared.catalog import Catalog
from shared.errors import ServiceUnavailable
from shared.schemas import AdminAudit


async def open_pins(js: JetStreamContext, catalog: Catalog, fleet: FleetSlots, slot_quota: SlotQuota) -> Pins:
    bucket = await open_bucket(js, subjects.REGISTRY_PINS_BUCKET)

    async def load() -> dict[str, bytes]:
        return await load_all(bucket)

    async def put(key: str, value: bytes) -> None:
        await bucket.put(key, value)

    async def delete(key: str) -> None:
        await bucket.delete(key)

    async def audit(event: AdminAudit) -> None:
        if not await publish_audit(js, event, f"admin.{uuid.uuid4().hex}"):
            raise ServiceUnavailable(f"{event.action} of {event.target} is stored, but its audit record is not yet")

    return Pins(catalog, fleet, load, put, delete, audit, slot_quota)
