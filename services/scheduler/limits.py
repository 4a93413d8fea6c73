"""Each tenant's limits: the registry's ``TenantQuota`` (KV ``lf_tenants``), else the configured defaults."""

from dataclasses import dataclass, field

from services.scheduler.settings import SchedulerSettings
from shared import subjects
from shared.bus import decode
from shared.errors import LorafleetError
from shared.schemas import TenantQuota, TenantRecord
from shared.undecodable import skip

TENANT_PREFIX = "tenant."


@dataclass(slots=True)
class Quotas:
    """Tenant id -> quota, changed at run time by the registry's KV entries; unset fields use ``defaults``
    (the platform's, every field set: 0 = no limit)."""

    defaults: TenantQuota
    _by_tenant: dict[str, TenantQuota] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: SchedulerSettings) -> "Quotas":
        return cls(TenantQuota(**settings.default_quota.model_dump()))

    def of(self, tenant: str) -> TenantQuota:
        own = self._by_tenant.get(tenant)
        if own is None:
            return self.defaults
        return TenantQuota(**{k: v if v is not None else getattr(self.defaults, k) for k, v in own})

    def set(self, tenant: str, quota: TenantQuota | None) -> None:
        if quota is None:
            self._by_tenant.pop(tenant, None)
        else:
            self._by_tenant[tenant] = quota

    def apply(self, key: str, value: bytes | None) -> None:
        """One KV entry of the tenants bucket (``tenant.<id>``); other keys (API keys) are not ours."""
        if not key.startswith(TENANT_PREFIX):
            return
        tenant = key[len(TENANT_PREFIX) :]
        if not value:
            self.set(tenant, None)
            return
        try:
            self.set(tenant, decode(TenantRecord, value).quota)
        except LorafleetError as e:  # the tenant keeps the quota it had
            skip(subjects.REGISTRY_TENANTS_BUCKET, key, e)
