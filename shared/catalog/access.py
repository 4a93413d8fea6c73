"""Who may use an adapter: one rule, applied by the registry at resolve and the auditor after the fact."""

from shared.schemas import AdapterRecord

SHARED_TENANT = "shared"


def may_use(record: AdapterRecord, tenant_id: str) -> bool:
    """Owner tenant, or a shared adapter whose scopes name the tenant or ``*``."""
    if record.tenant_id == tenant_id:
        return True
    return record.tenant_id == SHARED_TENANT and (tenant_id in record.allowed_scopes or "*" in record.allowed_scopes)
