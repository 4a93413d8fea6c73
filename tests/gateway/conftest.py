"""A gateway (real uvicorn, real key mirror) in front of a real registry on its own nats-server,
with a fake worker answering inference requests; tenants and keys made through registry ops."""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from lorafleet.cli.infra import Server, free_port, start_nats
from services.auditor.service import run as run_auditor
from services.auditor.settings import AuditorSettings
from services.gateway.app import create_app
from services.gateway.auth import ApiKeys
from services.gateway.context import GatewayContext
from services.gateway.key_watch import follow_keys
from services.gateway.readiness import ClusterView
from services.gateway.settings import GatewaySettings
from services.registry.service import run as run_registry
from services.registry.settings import RegistrySettings
from shared import subjects
from shared.bus import connect, request
from shared.catalog.view import CatalogView, follow_catalog
from shared.errors import Unauthorized
from shared.heartbeat import publish_heartbeats
from shared.prompt_tokens import PromptTokens
from shared.schemas import (
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ServiceHeartbeat,
    TenantsReply,
    WorkerHeartbeat,
)
from tests.gateway.fake_worker import WORKER_ID, FakeWorker
from tests.helpers.adapters import tiny_llama

BASE = "tiny-llama"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gw_nats(tmp_path_factory: pytest.TempPathFactory):
    server: Server = start_nats(free_port(), tmp_path_factory.mktemp("gw-nats"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gw-base") / BASE
    tiny_llama().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smol_tokens(smollm_dir: Path) -> PromptTokens:
    return PromptTokens.load(smollm_dir)


@dataclass
class Gateway:
    url: str
    nc: object
    worker: FakeWorker
    keys: ApiKeys
    cluster: ClusterView
    admin_key: str
    catalog: CatalogView

    async def tenant(self, name: str | None = None, scopes: tuple[str, ...] = ("inference",)) -> tuple[str, str]:
        """A new tenant and one key of it: (tenant_id, key)."""
        tenant = name or f"t{uuid.uuid4().hex[:10]}"
        await request(
            self.nc,
            subjects.registry("tenant_create"),
            CreateTenantRequest(tenant_id=tenant, actor="test"),
            TenantsReply,
            5,
        )
        return tenant, await self.key(tenant, scopes)

    async def key(self, tenant: str, scopes: tuple[str, ...] = ("inference",)) -> str:
        reply = await request(
            self.nc,
            subjects.registry("api_key_create"),
            CreateApiKeyRequest(tenant_id=tenant, scopes=list(scopes), actor="test"),
            ApiKeyCreatedReply,
            5,
        )
        deadline = time.monotonic() + 1
        while True:  # the mirror learns of the key through its KV watch, within milliseconds
            try:
                self.keys.principal(reply.key)
                return reply.key
            except Unauthorized:
                assert time.monotonic() < deadline, "the gateway never saw the new key"
                await asyncio.sleep(0.005)

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10)


def gateway_settings(nats_url: str, **over) -> GatewaySettings:
    values = {
        "nats_url": nats_url,
        "api_keys": {"config-key": "configured"},
        "max_body_bytes": 200_000,
        "max_prompt_tokens": 512,  # a chat with tools is ~250 tokens
        "max_tokens_limit": 512,
        "request_timeout_s": 2,
        "accept_timeout_s": 2,
        "feedback_lookup_s": 0.3,
    }
    return GatewaySettings(**{**values, **over})


@pytest.fixture
def gateway_over() -> dict:
    """GatewaySettings fields a test sets over gateway_settings' (parametrize it by name to change them)."""
    return {}


@pytest.fixture
async def gateway(gw_nats, tiny_base_dir, tmp_path, smol_tokens, gateway_over) -> AsyncIterator[Gateway]:
    stop = asyncio.Event()
    reg = RegistrySettings(
        nats_url=gw_nats.url,
        model_dir=str(tiny_base_dir),
        instance_id="reg-gw",
        heartbeat_interval_s=0.2,
        dev_mode=True,
        store_dir=str(tmp_path / "store"),
    )
    nc = await connect(gw_nats.url, "gateway-test")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    registry = asyncio.create_task(run_registry(reg, stop))
    await beats.next_msg(timeout=60)
    await beats.unsubscribe()
    worker = FakeWorker(nc)
    await worker.start()
    cluster = ClusterView(3600)
    cluster.on_service(ServiceHeartbeat(service="scheduler", instance_id="s", ready=True))
    cluster.on_worker(
        WorkerHeartbeat(
            worker_id=WORKER_ID,
            base_model=BASE,
            ready=True,
            running=0,
            waiting=0,
            max_running=8,
            kv_blocks_free=1,
            kv_blocks_total=1,
        )
    )
    keys = ApiKeys({"config-key": "configured"})
    watch = asyncio.create_task(follow_keys(nc, keys))
    port = free_port()
    settings = gateway_settings(gw_nats.url, port=port, **gateway_over)
    followed = await follow_catalog(nc, settings.registry_timeout_s, barrier=("gateway", settings.instance_id))
    # as the service does: the registry learns of this gateway and waits for its mirror on each write
    beating = asyncio.create_task(publish_heartbeats(nc, "gateway", settings.instance_id, 0.2, lambda: (True, "")))
    app = create_app(GatewayContext(settings, nc, nc.jetstream(), cluster, keys, followed.view, smol_tokens))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not (server.started and keys.loaded):  # noqa: ASYNC110  # uvicorn and the key watch set plain flags
        await asyncio.sleep(0.02)
    gw = Gateway(f"http://127.0.0.1:{port}", nc, worker, keys, cluster, "", followed.view)
    _, gw.admin_key = await gw.tenant(scopes=("platform_admin", "inference"))
    yield gw
    server.should_exit = True
    await serving
    watch.cancel()
    followed.stop()
    beating.cancel()
    stop.set()
    await registry
    for task in worker.tasks:
        task.cancel()
    await nc.close()


@pytest.fixture
async def auditor(gw_nats, tmp_path: Path) -> AsyncIterator[None]:
    settings = AuditorSettings(
        nats_url=gw_nats.url,
        db_path=str(tmp_path / "audit.sqlite3"),
        metrics_port=-1,
        head_interval_s=5,
        chain_id=f"fb{uuid.uuid4().hex[:8]}",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(run_auditor(settings, stop))
    yield
    stop.set()
    await task
