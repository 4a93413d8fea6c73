"""Cross-check a completion against the registry: the tenant was permitted to use the adapter,
and the digest that served it is the registry's for that version."""

from shared.catalog.access import may_use
from shared.schemas import AdapterRecord, CompletionAudit, ViolationAudit


def check_completion(event: CompletionAudit, record: AdapterRecord | None) -> list[ViolationAudit]:
    """Violations found (empty when all is well). ``record`` is None when the registry has no such version."""
    if event.adapter_id is None:
        return []

    def violation(kind: str, detail: str) -> ViolationAudit:
        return ViolationAudit(
            violation=kind,
            request_id=event.request_id,
            tenant_id=event.tenant_id,
            adapter_id=event.adapter_id,
            adapter_version=event.adapter_version,
            detail=detail,
        )

    if record is None:
        return [violation("integrity", f"the registry has no {event.adapter_id} v{event.adapter_version}")]
    found = []
    if not may_use(record, event.tenant_id):
        found.append(
            violation(
                "tenant_isolation",
                f"tenant {event.tenant_id} was served {record.adapter_id} of tenant {record.tenant_id}",
            )
        )
    if event.adapter_digest is not None and event.adapter_digest != record.digest:
        found.append(
            violation(
                "integrity",
                f"served digest {event.adapter_digest[:12]} is not the registry's "
                f"{record.digest[:12]} for v{record.version}",
            )
        )
    return found
