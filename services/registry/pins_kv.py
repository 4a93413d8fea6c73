"""Open the ``lf_pins`` KV bucket and build the Pins ops on it, their changes audited on the AUDIT stream."""

from nats.js import JetStreamContext

from services.registry.kv import AuditedBucket
from services.registry.pin_ops import FleetSlots, Pins, SlotQuota
from shared import subjects
from shared.catalog.records import Catalog


async def open_pins(js: JetStreamContext, catalog: Catalog, fleet: FleetSlots, slot_quota: SlotQuota) -> Pins:
    b = await AuditedBucket.open(js, subjects.REGISTRY_PINS_BUCKET)
    return Pins(catalog, fleet, b.load, b.put, b.delete, b.audit, slot_quota)
