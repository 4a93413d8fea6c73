"""The in-memory catalog of adapter records: every version of every adapter, plus aliases.

The registry loads it from its KV bucket at start and writes every change through to KV before
applying it here, so resolution never waits on storage. Each gateway keeps a mirror of it,
fed by a watch on the same bucket, to resolve requests without a registry round trip.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from shared.schemas import AdapterRecord, AdapterStatus, PinRecord

RELEASED: frozenset[AdapterStatus] = frozenset({"canary", "production"})


@dataclass(frozen=True, slots=True)
class Change:
    """One record's transition; ``before`` is None for a newly registered version."""

    kind: str  # an AdapterEvent kind
    before: AdapterRecord | None
    after: AdapterRecord


def record_key(adapter_id: str, version: int) -> str:
    """KV key of one version: ``<adapter_id>.<version>``."""
    return f"{adapter_id}.{version}"


class Catalog:
    def __init__(self, records: Iterable[AdapterRecord] = ()) -> None:
        self._versions: dict[str, dict[int, AdapterRecord]] = {}
        self._aliases: dict[tuple[str, str], str] = {}  # (tenant_id, alias) -> adapter_id
        for record in records:
            self.put(record)

    def __len__(self) -> int:
        return sum(len(v) for v in self._versions.values())

    def put(self, record: AdapterRecord) -> None:
        self._versions.setdefault(record.adapter_id, {})[record.version] = record
        for alias in record.aliases:
            self._aliases[(record.tenant_id, alias)] = record.adapter_id

    def apply(self, changes: Iterable[Change]) -> None:
        for change in changes:
            self.put(change.after)

    def get(self, adapter_id: str, version: int) -> AdapterRecord | None:
        return self._versions.get(adapter_id, {}).get(version)

    def versions(self, adapter_id: str) -> list[AdapterRecord]:
        """Every version of the adapter, oldest first."""
        return [r for _, r in sorted(self._versions.get(adapter_id, {}).items())]

    def latest(self, adapter_id: str) -> AdapterRecord | None:
        versions = self._versions.get(adapter_id)
        return versions[max(versions)] if versions else None

    def owner(self, adapter_id: str) -> str | None:
        latest = self.latest(adapter_id)
        return latest.tenant_id if latest else None

    def alias_owner(self, tenant_id: str, alias: str) -> str | None:
        """The adapter a tenant's alias points at, if any."""
        return self._aliases.get((tenant_id, alias))

    def adapters(self) -> Iterator[str]:
        return iter(self._versions)

    def released(self, adapter_id: str) -> tuple[AdapterRecord | None, AdapterRecord | None]:
        """(production, canary) versions of the adapter; each may be None."""
        production = canary = None
        for record in self._versions.get(adapter_id, {}).values():
            if record.status == "production":
                production = record
            elif record.status == "canary":
                canary = record
        return production, canary


def pinned_versions(pin: PinRecord, catalog: Catalog) -> list[AdapterRecord]:
    """The versions a pin holds now: its own (unless retired or revoked), or each one served (production, canary)."""
    if pin.version is not None:
        record = catalog.get(pin.adapter_id, pin.version)
        return [record] if record is not None and record.status not in ("retired", "revoked") else []
    return [r for r in catalog.released(pin.adapter_id) if r is not None]
