"""The stack a load run targets: nats-server, redis-server and the five services on loopback, a base
model (the embedded SmolLM2 or a tiny random Llama), tenants with their API keys.

Two shapes: ``single`` (one nats-server, one process of each service: ``lorafleet up``'s) and
``cluster`` (the HA profile of docs/operations.md: a 3-node NATS cluster with every stream, bucket
and object store at replicas 3, two registries, two schedulers, two gateways; the load client
spreads its requests over both gateways, as the load balancer in front of them would)."""

import asyncio
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.tiny_model import cached_tiny_model
from lorafleet.cli.adapter_cmd import cli_connect
from lorafleet.cli.infra import (
    Server,
    cluster_url,
    free_port,
    start_nats,
    start_nats_cluster,
    start_redis,
    wait_jetstream,
)
from lorafleet.cli.stack import SERVICES, Stack, wait_ready
from shared import subjects
from shared.base_model import EMBEDDED_MODEL_NAME, default_cache_dir, resolve_model_dir
from shared.bus import request
from shared.schemas import (
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    SetQuotaRequest,
    SloClass,
    TenantQuota,
    TenantsReply,
)

# a benchmark measures the platform's capacity, not the tenant limits a deployment starts with
UNLIMITED_QUOTAS = {
    "LF_DEFAULT_QUOTA__REQUESTS_PER_MIN": "0",
    "LF_DEFAULT_QUOTA__TOKENS_PER_MIN": "0",
    "LF_DEFAULT_QUOTA__MAX_CONCURRENT": "0",
}

ACTOR = "bench-load"
REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
TINY_KINDS = {"tiny": "tiny-llama", "tiny-h64": "tiny-llama-h64"}  # --base-model -> cache name
SHAPES = ("single", "cluster")
CLUSTER_NODES = 3
CLUSTER_REPLICAS = {"registry": 2, "scheduler": 2, "gateway": 2}  # processes of each service (others: 1)


@dataclass(slots=True)
class BenchStack:
    root: Path
    nodes: list[Server]  # nats-server: one, or each node of the cluster
    redis: Server
    stack: Stack
    urls: list[str]  # every gateway
    model_dir: Path
    model_name: str

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def nats_url(self) -> str:
        return cluster_url(self.nodes)

    def pids(self) -> dict[str, int]:
        """Process id of every service and of nats-server and redis-server, by name."""
        nats = {f"nats-server{'' if i == 0 else f'-{i}'}": n.proc.pid for i, n in enumerate(self.nodes)}
        return {**{k: p.pid for k, p in self.stack.procs.items()}, **nats, "redis-server": self.redis.proc.pid}

    def stop(self, keep_logs: bool = False) -> None:
        self.stack.stop_all()
        self.redis.stop()
        for node in self.nodes:
            if node.proc.poll() is None:
                node.stop()
        if not keep_logs:
            shutil.rmtree(self.root, ignore_errors=True)


def base_model_dir(kind: str) -> tuple[Path, str]:
    """(directory, served name) of ``smollm2`` (embedded), ``tiny`` (random 2-layer Llama, SmolLM2
    tokenizer) or ``tiny-h64`` (the same with head size 64, which vLLM's CPU build can run).

    The tiny models are seeded, so each is made once into the model cache and reused."""
    os.environ.setdefault("LF_MODEL_CACHE", str(default_cache_dir()))
    if kind == "smollm2":
        return resolve_model_dir(None), EMBEDDED_MODEL_NAME
    name = TINY_KINDS[kind]
    return cached_tiny_model(Path(os.environ["LF_MODEL_CACHE"]), name), name


def worker_launch(engine: str) -> tuple[str | None, dict[str, str]]:
    """(interpreter, environment) of a worker on ``engine``: ``builtin`` runs in this environment;
    ``vllm`` runs under .venv-vllm's interpreter (vLLM cannot install beside the project's transformers)
    importing this checkout, with LF_WORKER_ENGINE=vllm."""
    if engine == "builtin":
        return None, {"LF_WORKER_ENGINE": "builtin"}
    if engine != "vllm":
        raise ValueError(f"unknown worker engine {engine!r}: builtin or vllm")
    if not VLLM_PYTHON.exists():
        raise ValueError(f"--engine vllm needs {VLLM_PYTHON}: run `make venv-vllm`")
    return str(VLLM_PYTHON), {"LF_WORKER_ENGINE": "vllm", "PYTHONPATH": str(REPO)}


def start_stack(
    kind: str,
    *,
    workers: int,
    request_timeout_s: float,
    ready_timeout_s: float = 600,
    extra_env: dict[str, str] | None = None,
    engine: str = "builtin",
    shape: str = "single",
) -> BenchStack:
    """Every process on free loopback ports, in ``shape`` (``single`` or ``cluster``); dev mode
    (unsigned adapters admitted), metrics off; the workers on ``engine`` (``worker_launch``)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown stack shape {shape!r}: {' or '.join(SHAPES)}")
    worker_python, worker_env = worker_launch(engine)
    model_dir, model_name = base_model_dir(kind)
    root = Path(tempfile.mkdtemp(prefix="lf-load-"))
    if shape == "cluster":
        nodes = start_nats_cluster([free_port() for _ in range(CLUSTER_NODES)], root / "nats", root)
    else:
        nodes = [start_nats(free_port(), root / "nats")]
    try:
        if shape == "cluster":
            asyncio.run(wait_jetstream(cluster_url(nodes), 60))
        redis = start_redis(free_port(), root / "redis")
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    replicas = CLUSTER_REPLICAS if shape == "cluster" else {}
    ports = [free_port() for _ in range(replicas.get("gateway", 1))]
    env = {
        "LF_NATS_URL": cluster_url(nodes),
        "LF_JETSTREAM_REPLICAS": str(len(nodes)),
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(ports[0]),
        "LF_HOST": "127.0.0.1",
        "LF_DB_PATH": str(root / "audit.sqlite3"),
        "LF_LOG_LEVEL": "WARNING",
        "LF_METRICS_PORT": "-1",
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_REQUEST_TIMEOUT_S": str(request_timeout_s),
        "LF_MODEL_CACHE": os.environ["LF_MODEL_CACHE"],
        **UNLIMITED_QUOTAS,
        **({} if kind == "smollm2" else {"LF_MODEL_DIR": str(model_dir)}),
        **(extra_env or {}),
    }
    stack = Stack(env, root / "logs")
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    running = BenchStack(root, nodes, redis, stack, urls, model_dir, model_name)
    try:
        for name in SERVICES:
            if name == "worker":
                continue
            for i in range(replicas.get(name, 1)):
                own = {"LF_INSTANCE_ID": f"{name}-{i}"} | ({"LF_PORT": str(ports[i])} if name == "gateway" else {})
                stack.start(name, own, key=name if i == 0 else f"{name}-{i}")
        for i in range(workers):
            stack.start(
                "worker",
                {"LF_WORKER_ID": f"load-w{i}", **worker_env},
                key=f"worker-{i}" if workers > 1 else "worker",
                python=worker_python,
            )
        asyncio.run(wait_ready(cluster_url(nodes), stack, SERVICES, ready_timeout_s))
        asyncio.run(wait_gateways(urls, ready_timeout_s))
    except BaseException:
        running.stop(keep_logs=True)
        raise
    return running


async def wait_gateways(urls: list[str], timeout_s: float) -> None:
    """Return once every gateway answers ``/readyz`` with 200 (a second replica's heartbeat may come
    after the first's, which is all ``wait_ready`` waits for)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            while True:
                try:
                    if (await client.get(f"{url}/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the gateway at {url} is not ready after {timeout_s:.0f} s")
                await asyncio.sleep(0.2)


async def create_tenants(nats_url: str, tenants: list[str]) -> dict[str, str]:
    """Create each tenant (no quota) and one inference key for it: tenant -> bearer key."""
    nc = await cli_connect(nats_url)
    keys = {}
    try:
        for tenant in tenants:
            await request(
                nc,
                subjects.registry("tenant_create"),
                CreateTenantRequest(tenant_id=tenant, actor=ACTOR),
                TenantsReply,
                10,
            )
            created = await request(
                nc,
                subjects.registry("api_key_create"),
                CreateApiKeyRequest(tenant_id=tenant, actor=ACTOR),
                ApiKeyCreatedReply,
                10,
            )
            keys[tenant] = created.key
    finally:
        await nc.drain()
    return keys


async def set_tiers(nats_url: str, tenants: list[str], tier: SloClass) -> None:
    """Give each tenant the SLO tier ``tier`` (its other limits stay unlimited by the stack's defaults)."""
    nc = await cli_connect(nats_url)
    try:
        for tenant in tenants:
            quota = TenantQuota(slo_tier=tier)
            message = SetQuotaRequest(tenant_id=tenant, quota=quota, actor=ACTOR)
            await request(nc, subjects.registry("quota_set"), message, TenantsReply, 10)
    finally:
        await nc.drain()


async def list_models(url: str, key: str) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        r.raise_for_status()
        return r.json()["data"]


async def wait_keys(url: str, keys: dict[str, str], timeout_s: float = 30) -> None:
    """Return once the gateway accepts every key (it mirrors new keys from the registry)."""
    deadline = time.monotonic() + timeout_s
    pending = dict(keys)
    while pending:
        for tenant, key in list(pending.items()):
            try:
                await list_models(url, key)
                del pending[tenant]
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"the gateway at {url} does not accept the keys of {sorted(pending)}")
        await asyncio.sleep(0.2)
