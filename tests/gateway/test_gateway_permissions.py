"""The gateway's NATS user may call exactly the registry ops its routes use, and read the key bucket."""

from lorafleet.cli.nats_permissions import service_permissions
from shared import subjects


def test_gateway_registry_ops_exclude_signer_trust():
    publish = set(service_permissions()["gateway"].publish)
    assert "lf.registry.>" not in publish
    assert subjects.registry("trust_key") not in publish and subjects.registry("keys") not in publish
    for op in (
        "resolve",
        "list",
        "register",
        "promote",
        "revoke",
        "tenant_create",
        "api_key_create",
        "api_key_revoke",
        "api_keys",
        "quota_set",
    ):
        assert subjects.registry(op) in publish
    assert f"$JS.API.CONSUMER.CREATE.KV_{subjects.REGISTRY_TENANTS_BUCKET}" in publish
    assert f"$KV.{subjects.REGISTRY_TENANTS_BUCKET}.>" not in publish
    assert f"$KV.{subjects.REGISTRY_TENANTS_BUCKET}.>" in service_permissions()["registry"].publish
