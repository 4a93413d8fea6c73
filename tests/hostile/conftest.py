"""One real stack for the hostile-input suite: NATS, Redis, registry, auditor, scheduler, gateway and
a single worker on a tiny random Llama, with two tenants that each own a released adapter.

Every hostile case asserts the exact typed error, then that nothing changed (``Stack.snapshot``)
and, where the platform audits the attempt, that the auditor's SQLite index holds the record."""

import asyncio
import base64
import json
import os
import pickle
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError
from prometheus_client.parser import text_string_to_metric_families

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import Server, free_port, start_redis
from lorafleet.cli.nats_auth import LocalAuth, start_secured_nats
from lorafleet.cli.nats_permissions import tenant_user
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import connect, request
from shared.schemas import (
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    ApiKeysReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ListAdaptersRequest,
    ListApiKeysRequest,
    ListKeysRequest,
    ListTenantsRequest,
    PromoteRequest,
    RegisterRequest,
    TenantsReply,
    TrustedKeysReply,
    TrustKeyRequest,
)
from shared.signing import KeyPair, generate_keypair
from tests.helpers.adapters import save_peft_adapter, tiny_llama
from tests.helpers.remote_sources import AWS_ENV, HttpsServer, MotoS3, make_ca
from tests.scheduler.conftest import wait_workers

MODEL = "tiny-llama"
WORKER = "w1"
# A sequence may be this long: a request a test keeps in flight asks for thousands of tokens, seconds of decoding
# however fast the machine (the tiny model runs about 1500 tokens a second on the reference CPU)
MAX_MODEL_LEN = 16384
MAX_BODY = 65_536
CONFIG_KEYS = {"key-demo": "demo", "key-other": "other"}
NATS_TENANTS = ("demo", "other", "direct")  # each with a direct-NATS user in its own account
AUDITOR = "main"  # the auditor's instance id: the subject of its signed heads, kept across restarts
SCRAPED = ("registry", "auditor", "scheduler")  # services whose /metrics the tests read
REMOTE_TIMEOUT_S = 3.0  # the registry's fetch time limit
REMOTE_MAX_FILE = 40_000  # bytes of one fetched file; the tiny adapter's weights are ~15 kB
GRAMMAR_BOUND_S = 6.0  # the worker's grammar compile time bound (test_grammar_hostile.py; 3 s was outlasted)


class _RunsCode:
    def __reduce__(self) -> tuple:
        return os.system, ("id",)


PICKLE = pickle.dumps(_RunsCode())  # runs os.system("id") when unpickled; only ever sent, never loaded here
Files = dict[str, bytes]


def adapter_files(directory: Path, **options: object) -> Files:
    """A real PEFT adapter for the tiny base (its projections are 64 wide, like ``tiny_llama``'s)."""
    save_peft_adapter(directory, tiny_llama(), **options)
    return {name: (directory / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)}


def inline(files: Files) -> dict[str, str]:
    return {name: base64.b64encode(data).decode() for name, data in files.items()}


@dataclass
class Keys:
    demo: str = "key-demo"
    other: str = "key-other"
    demo_admin: str = ""
    platform: str = ""
    revoked: str = ""


@dataclass
class HostileStack:
    stack: Stack
    nats: Server
    auth: LocalAuth  # the production permission model: a NATS user per service, worker and tenant
    gateway_url: str
    db_path: Path
    files: Files  # the adapter every tenant released, as pushed
    trusted_dir: Path  # the registry admits file:// sources under it
    signer: KeyPair = field(default_factory=generate_keypair)  # trusted as "release"
    fingerprint: str = ""  # the registry's base model
    keys: Keys = field(default_factory=Keys)
    adapters: dict[str, str] = field(default_factory=dict)  # tenant -> its released adapter id
    redis_url: str = ""  # quota counters and dedupe markers live there
    s3: MotoS3 | None = None  # the remote sources the registry may fetch from (test_remote_sources_hostile.py)
    https: HttpsServer | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict)  # service -> its /metrics port

    def service_env(self, name: str) -> dict[str, str]:
        """What one service starts with beside the stack's environment: its own NATS user, its metrics port."""
        env = self.auth.worker_env(WORKER) if name == "worker" else self.auth.service_env(name)
        if name in self.metrics_ports:
            env["LF_METRICS_PORT"] = str(self.metrics_ports[name])
        if name == "auditor":
            env["LF_INSTANCE_ID"] = AUDITOR
        return env

    async def restart(self, name: str) -> None:
        """Stop one service and start it again; return once it is ready (raise if it exits)."""
        self.stack.stop(name)
        self.stack.start(name, extra_env=self.service_env(name))
        await wait_ready(self.admin_url, self.stack, (name,), 120)

    def scrape(self, service: str, metric: str, **labels: str) -> float:
        """One sample of ``service``'s /metrics (0 when it has none yet)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[service]}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == metric and sample.labels == labels:
                    return sample.value
        return 0.0

    @property
    def admin_url(self) -> str:
        """The operator's URL (the admin user, every subject of the platform's account)."""
        return self.auth.admin_url(self.nats.url)

    async def connect_tenant(self, tenant: str, **options: object) -> NATS:
        """A direct-NATS client of ``tenant``, as README's programs connect."""
        return await nats.connect(
            self.nats.url,
            user=tenant_user(tenant),
            password=self.auth.tenant_password(tenant),
            inbox_prefix=subjects.tenant_inbox(tenant),
            allow_reconnect=False,
            **options,
        )

    def client(self, key: str | None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.gateway_url, headers=headers, timeout=30)

    async def snapshot(self, nc: NATS) -> dict:
        """Everything a hostile input must leave as it was: registry records, tenants, keys, trusted
        signers, stored and uploaded objects, and the INFER stream (no request reached the queue)."""
        js = nc.jetstream()
        records = await request(nc, subjects.registry("adapters"), ListAdaptersRequest(), AdapterRecordsReply, 5)
        tenants = await request(nc, subjects.registry("tenants"), ListTenantsRequest(), TenantsReply, 5)
        keys = await request(nc, subjects.registry("api_keys"), ListApiKeysRequest(), ApiKeysReply, 5)
        signers = await request(nc, subjects.registry("keys"), ListKeysRequest(), TrustedKeysReply, 5)
        objects = {}
        for bucket in (subjects.ADAPTER_STORE_BUCKET, subjects.ADAPTER_UPLOADS_BUCKET):
            try:
                listed = await (await js.object_store(bucket)).list(ignore_deletes=True)
            except NotFoundError:  # an empty store
                listed = []
            objects[bucket] = sorted(o.name for o in listed)
        infer = await js.stream_info(subjects.INFER_STREAM)
        return {
            "records": [r.model_dump(exclude={"created_at"}) for r in records.records],
            "tenants": [t.tenant_id for t in tenants.tenants],
            "keys": [k.model_dump() for k in keys.keys],
            "signers": signers.keys,
            "objects": objects,
            "infer_last_seq": infer.state.last_seq,
        }

    def audits(self, kind: str, tenant: str, since: float) -> list[dict]:
        with sqlite3.connect(self.db_path) as db:
            rows = db.execute(
                "SELECT body FROM audit WHERE kind = ? AND tenant_id = ? AND ts >= ? ORDER BY pos",
                (kind, tenant, since),
            ).fetchall()
        return [json.loads(body) for (body,) in rows]

    async def wait_audit(self, kind: str, tenant: str, since: float, timeout_s: float = 10, **match: object) -> dict:
        """The first audit record of ``kind`` for ``tenant`` since ``since`` whose fields equal ``match``."""
        deadline = time.monotonic() + timeout_s
        while True:
            for body in self.audits(kind, tenant, since):
                if all(body.get(k) == v for k, v in match.items()):
                    return body
            assert time.monotonic() < deadline, f"no {kind} audit {match} for {tenant}"
            await asyncio.sleep(0.1)

    async def assert_alive(self) -> None:
        """No process died, and the next good request is served."""
        assert self.stack.dead() == {}
        async with self.client(self.keys.demo) as c:
            r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


async def registry_call(nc: NATS, op: str, message, reply_type):
    return await request(nc, subjects.registry(op), message, reply_type, 10)


async def _seed(running: HostileStack) -> None:
    nc = await connect(running.admin_url, "hostile-seed")
    try:
        for tenant in ("demo", "other"):
            await registry_call(nc, "tenant_create", CreateTenantRequest(tenant_id=tenant, actor="test"), TenantsReply)
            adapter_id = f"{tenant}-secret"
            register = RegisterRequest(
                adapter_id=adapter_id,
                tenant_id=tenant,
                task_type="chat",
                inline_files=inline(running.files),
                actor="test",
            )
            registered = await registry_call(nc, "register", register, AdapterRecordsReply)
            running.fingerprint = registered.records[0].base_model_fingerprint
            promote = PromoteRequest(adapter_id=adapter_id, version=1, traffic_percent=100, actor="test")
            await registry_call(nc, "promote", promote, AdapterRecordsReply)
            running.adapters[tenant] = adapter_id

        async def key(tenant: str, scopes: list[str]) -> str:
            message = CreateApiKeyRequest(tenant_id=tenant, scopes=scopes, actor="test")
            return (await registry_call(nc, "api_key_create", message, ApiKeyCreatedReply)).key

        running.keys.demo_admin = await key("demo", ["admin", "inference"])
        running.keys.platform = await key("demo", ["platform_admin"])
        running.keys.revoked = await key("demo", ["inference"])
        trust = TrustKeyRequest(signer="release", public_key=running.signer.public_b64, tenants=["demo"], actor="test")
        await registry_call(nc, "trust_key", trust, TrustedKeysReply)
    finally:
        await nc.close()
    async with running.client(running.keys.revoked) as c:
        deadline = time.monotonic() + 10
        while (await c.get("/v1/models")).status_code != 200:  # the gateway's key mirror caught up
            assert time.monotonic() < deadline, "the gateway never saw the seeded keys"
            await asyncio.sleep(0.1)
    async with running.client(running.keys.demo_admin) as c:
        key_id = running.keys.revoked.split("-")[1]
        assert (await c.delete(f"/admin/keys/{key_id}")).status_code == 200


@pytest.fixture(scope="session")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileStack]:
    root = tmp_path_factory.mktemp("hostile")
    model_dir = make_tiny_model(root / MODEL, max_positions=MAX_MODEL_LEN)
    (root / "logs").mkdir()
    nats, auth = start_secured_nats(free_port(), root / "state", root / "logs" / "nats.log", (WORKER,), NATS_TENANTS)
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps(CONFIG_KEYS),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DB_PATH": str(root / "audit.db"),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_MAX_BODY_BYTES": str(MAX_BODY),
        "LF_MAX_RANK": "16",
        "LF_LIVENESS_TIMEOUT_S": "5",
        "LF_ACCEPT_TIMEOUT_S": "10",
        "LF_NO_WORKER_GRACE_S": "5",
        "LF_GATEWAY_SYNC_TIMEOUT_S": "1.8",  # under the gateway's registry bound (2 s); a test stops the scheduler 1 s
        "LF_ENGINE__MAX_NUM_SEQS": "4",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(32 * 2**20),  # 64 Ki tokens of the tiny model: four longest sequences
        "LF_ENGINE__MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "LF_ENGINE__MAX_NUM_BATCHED_TOKENS": str(MAX_MODEL_LEN),
        "LF_LORA__MAX_NUM_TOKENS": str(MAX_MODEL_LEN),
        "LF_MAX_TOKENS_LIMIT": str(MAX_MODEL_LEN),  # the gateway's bound, which the scheduler applies too
        "LF_METRICS_PORT": "-1",
        "LF_WORKER_ID": WORKER,
        "LF_GRAMMAR__COMPILE_TIMEOUT_S": str(GRAMMAR_BOUND_S),
        "LF_TRUSTED_SOURCE_DIRS": json.dumps([str(root / "trusted")]),
    }
    (root / "trusted").mkdir()
    (root / "spool").mkdir()
    s3, https = MotoS3(), HttpsServer(make_ca(root / "ca"))
    env.update(AWS_ENV)
    env.update({
        "LF_REMOTE__S3_ENABLED": "true",
        "LF_REMOTE__HTTPS_ENABLED": "true",
        "LF_REMOTE__S3_ENDPOINT_URL": s3.endpoint,
        "LF_REMOTE__CA_FILE": str(root / "ca" / "ca.pem"),
        "LF_REMOTE__TIMEOUT_S": str(REMOTE_TIMEOUT_S),
        "LF_REMOTE__MAX_FILE_BYTES": str(REMOTE_MAX_FILE),
        "LF_REMOTE__MAX_TENANT_FETCHES": "1",  # test_remote_sources_hostile.py fills demo's one fetch slot
        "LF_REMOTE__SPOOL_DIR": str(root / "spool"),
    })  # fmt: skip
    stack = Stack(env, root / "logs")
    running = HostileStack(
        stack,
        nats,
        auth,
        f"http://127.0.0.1:{port}",
        root / "audit.db",
        adapter_files(root / "adapter", seed=1),
        root / "trusted",
        redis_url=redis.url,
        s3=s3,
        https=https,
        metrics_ports={name: free_port() for name in SCRAPED},
    )
    try:
        for name in ("registry", "auditor", "scheduler", "gateway", "worker"):
            stack.start(name, extra_env=running.service_env(name))
        asyncio.run(wait_ready(running.admin_url, stack, ("registry", "auditor", "scheduler", "gateway"), 120))
        asyncio.run(wait_workers(running.admin_url, {WORKER}, 120))
        asyncio.run(_seed(running))
        yield running
    finally:
        stack.stop_all(timeout_s=5)
        redis.stop()
        nats.stop()
        s3.stop()
        https.stop()


@pytest.fixture
async def nc(hostile: HostileStack):
    """An operator connection to the stack's NATS (the admin user)."""
    client = await connect(hostile.admin_url, "hostile-test")
    yield client
    await client.close()
