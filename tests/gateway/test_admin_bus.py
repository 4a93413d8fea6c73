"""The gateway's admin API in process (its FastAPI app, no uvicorn) in front of the registry's real
tenant and key handlers on the in-memory bus: scoping, typed registry refusals as HTTP errors,
and a registry that is down or silent. The registry's KV writes feed the gateway's key mirror
directly, as the bucket watch would. No server process."""

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.gateway.app import create_app
from services.gateway.auth import ApiKeys
from services.gateway.context import GatewayContext
from services.gateway.readiness import ClusterView
from services.gateway.settings import GatewaySettings
from services.registry.tenants import Tenants
from shared import subjects
from shared.bus import serve
from shared.catalog.view import CatalogView
from shared.memory_bus import MemoryBus
from shared.schemas import (
    AdminAudit,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListApiKeysRequest,
    ListTenantsRequest,
    ResolveReply,
    ResolveRequest,
    RevokeApiKeyRequest,
    SetQuotaRequest,
)

REGISTRY_TIMEOUT_S = 0.2


@dataclass
class Admin:
    bus: MemoryBus
    registry_nc: NATS
    tenants: Tenants
    client: Callable[[str | None], httpx.AsyncClient]
    platform_key: str = ""
    asked: list[str] = field(default_factory=list)  # registry subjects, in the order they were asked

    async def serve_tenant_ops(self) -> None:
        ops = {
            "tenant_create": (CreateTenantRequest, self.tenants.create_tenant),
            "tenants": (ListTenantsRequest, self.tenants.list_tenants),
            "quota_set": (SetQuotaRequest, self.tenants.set_quota),
            "api_key_create": (CreateApiKeyRequest, self.tenants.create_key),
            "api_key_revoke": (RevokeApiKeyRequest, self.tenants.revoke_key),
            "api_keys": (ListApiKeysRequest, self.tenants.list_keys),
        }
        for op, (model, handler) in ops.items():
            await serve(self.registry_nc, subjects.registry(op), model, handler)


@pytest.fixture
async def admin() -> AsyncIterator[Admin]:
    bus = MemoryBus(seed=0)
    keys = ApiKeys({})
    keys.loaded = True

    async def put(kv_key: str, value: bytes) -> None:
        keys.apply(kv_key, value)  # what follow_keys does with each entry of the bucket

    async def ask_registry(req: ResolveRequest) -> ResolveReply:
        raise AssertionError("the admin API never resolves models")

    async def audit(event: AdminAudit) -> None:
        pass  # tests/registry/test_admin_audit.py follows these records on the AUDIT stream

    gateway_nc = bus.connect("gateway")
    settings = GatewaySettings(nats_url="nats://memory", api_keys={}, registry_timeout_s=REGISTRY_TIMEOUT_S)
    context = GatewayContext(
        settings,
        gateway_nc,
        None,
        ClusterView(3600),
        keys,
        CatalogView(ask_registry),  # type: ignore[arg-type]
    )
    app = create_app(context)

    def client(key: str | None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", headers=headers)

    wired = Admin(bus, bus.connect("registry"), Tenants({}, put, audit), client)

    await wired.tenants.create_tenant(CreateTenantRequest(tenant_id="ops", actor="test"))
    created = await wired.tenants.create_key(
        CreateApiKeyRequest(tenant_id="ops", scopes=["platform_admin"], actor="test")
    )
    wired.platform_key = created.key
    yield wired
    await gateway_nc.close()
    await wired.registry_nc.drain()


async def test_a_platform_admin_onboards_a_tenant_whose_admin_is_scoped_to_it(admin: Admin) -> None:
    await admin.serve_tenant_ops()

    async def spy(msg: Msg) -> None:
        admin.asked.append(msg.subject)

    # (a listener like this one is interest too: with it, an unserved op would time out, not be a 503)
    await admin.bus.connect("spy").subscribe("lf.registry.>", cb=spy)
    async with admin.client(admin.platform_key) as ops:
        r = await ops.post("/admin/tenants", json={"tenant_id": "acme"})
        assert r.status_code == 201, r.text
        r = await ops.post("/admin/keys", json={"tenant_id": "acme", "scopes": ["admin"]})
        assert r.status_code == 201, r.text
        acme_key = r.json()["key"]
        r = await ops.post("/admin/tenants", json={"tenant_id": "acme"})  # the registry's Conflict, as HTTP
        assert (r.status_code, r.json()["error"]["code"]) == (409, "conflict")
        r = await ops.post("/admin/tenants", json={"tenant_id": "shared"})  # its InvalidRequest
        assert (r.status_code, r.json()["error"]["param"]) == (400, "tenant_id")
    async with admin.client(acme_key) as acme:  # usable at once: the mirror holds it
        r = await acme.get("/admin/tenants")
        assert [t["tenant_id"] for t in r.json()["tenants"]] == ["acme"]
        asked = len(admin.asked)
        r = await acme.get("/admin/keys", params={"tenant": "ops"})  # another tenant: the missing one's 404
        assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
        r = await acme.post("/admin/tenants", json={"tenant_id": "evil"})
        assert (r.status_code, r.json()["error"]["code"]) == (403, "forbidden")
        await admin.bus.settle()
        assert len(admin.asked) == asked  # refused at the gateway, the registry never asked
        r = await acme.get("/admin/keys")
        [own] = r.json()["keys"]
        assert own["tenant_id"] == "acme" and "secret" not in r.text
        r = await acme.delete(f"/admin/keys/{own['key_id']}")
        assert r.status_code == 200 and r.json()["keys"][0]["revoked"]
        r = await acme.get("/admin/tenants")  # the revocation reached the mirror before the reply
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")


async def test_a_registry_that_is_down_or_silent_is_503_or_504(admin: Admin) -> None:
    async with admin.client(admin.platform_key) as ops:
        r = await ops.get("/admin/tenants")  # nothing serves lf.registry.tenants
        assert (r.status_code, r.json()["error"]["code"]) == (503, "service_unavailable")

        async def never_answers(msg: Msg) -> None:
            return None

        await admin.registry_nc.subscribe(subjects.registry("tenants"), cb=never_answers)
        r = await ops.get("/admin/tenants")
        assert (r.status_code, r.json()["error"]["code"]) == (504, "upstream_timeout")
