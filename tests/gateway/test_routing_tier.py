"""The tier routing policies match in the gateway is the one the scheduler gives the tenant: its own
record's, else the fleet default (LF_DEFAULT_QUOTA__SLO_TIER), so both evaluate a rule on tier alike."""

from services.gateway.auth import ApiKeys
from services.gateway.settings import GatewaySettings
from shared.schemas import TenantQuota, TenantRecord


def _record(tenant: str, tier: str | None) -> bytes:
    return TenantRecord(tenant_id=tenant, quota=TenantQuota(slo_tier=tier)).model_dump_json().encode()


def test_a_tenant_without_its_own_tier_has_the_fleet_default_and_its_record_overrides_it() -> None:
    keys = ApiKeys({}, default_tier="batch")
    assert keys.tier("acme") == "batch"
    keys.apply("tenant.acme", _record("acme", "interactive"))
    assert keys.tier("acme") == "interactive"
    keys.apply("tenant.acme", _record("acme", None))  # its record leaves the tier unset: the default again
    assert keys.tier("acme") == "batch"
    keys.apply("tenant.acme", None)
    assert keys.tier("acme") == "batch"


def test_the_gateway_reads_the_fleet_default_tier_from_the_scheduler_s_variable(monkeypatch) -> None:
    monkeypatch.setenv("LF_DEFAULT_QUOTA__SLO_TIER", "batch")
    assert GatewaySettings().default_quota.slo_tier == "batch"
    assert ApiKeys({}).tier("acme") == "standard"
