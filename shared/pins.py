"""What a pin holds: the registry checks pins against the fleet's slots with it, the workers keep it resident."""

from shared.catalog.records import Catalog
from shared.schemas import AdapterRecord, PinRecord


def pinned_versions(pin: PinRecord, catalog: Catalog) -> list[AdapterRecord]:
    """The versions a pin holds now: its own (unless retired or revoked), or each one served (production, canary)."""
    if pin.version is not None:
        record = catalog.get(pin.adapter_id, pin.version)
        return [record] if record is not None and record.status not in ("retired", "revoked") else []
    return [r for r in catalog.released(pin.adapter_id) if r is not None]
