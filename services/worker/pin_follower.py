"""The pins this worker keeps resident: the registry's ``lf_pins`` bucket, mirrored and applied to the cache.

Applied on start (a restarted worker pins again), on every pin added or removed, on every adapter
event (a promotion moves a pin of the served version), and every ``refresh_s`` (a pinned load that
failed is started again). A pin of an adapter not resident makes it resident and keeps it there;
what the cache refuses (its rank class full of pins) is retried and reported in heartbeats.
"""

from collections.abc import Callable

import structlog

from services.worker.adapter_cache.hierarchy import CacheHierarchy
from shared.adapter_keys import adapter_key
from shared.catalog.records import Catalog, pinned_versions
from shared.schemas import AdapterRecord, PinRecord

log = structlog.get_logger("worker")


class PinFollower:
    """Not thread-safe: run ``apply`` and ``reconcile`` on the event loop."""

    def __init__(self, worker_id: str, cache: CacheHierarchy, catalog: Callable[[], Catalog]) -> None:
        self.worker_id = worker_id
        self.records: dict[str, PinRecord] = {}  # KV key -> pin
        self._cache = cache
        self._catalog = catalog
        self._applied: set[str] = set()  # adapter keys this follower pinned

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """One entry of the pins bucket (``shared.kv_follow`` Apply)."""
        if value is None:
            self.records.pop(key, None)
        else:
            self.records[key] = PinRecord.model_validate_json(value)
        self.reconcile()

    def wanted(self) -> dict[str, AdapterRecord]:
        """Adapter key -> version record of every version the pins naming this worker hold now, oldest pin first."""
        catalog = self._catalog()
        wanted: dict[str, AdapterRecord] = {}
        for pin in sorted(self.records.values(), key=lambda p: (p.created_at, p.key)):
            if pin.applies_to(self.worker_id):
                for record in pinned_versions(pin, catalog):
                    wanted.setdefault(adapter_key(record.adapter_id, record.version), record)
        return wanted

    def reconcile(self) -> None:
        wanted = self.wanted()
        for key in sorted(self._applied - set(wanted)):
            self._cache.unpin(key)
        for key, record in wanted.items():
            if not self._cache.pin(key, record.rank, record.tenant_id) and key not in self._applied:
                log.warning("pin_refused", adapter=key, reason="its rank class is full of pins")
        self._applied = set(wanted)
