"""Task routes and routing policies on the real stack (nats-server, redis-server, registry,
scheduler, gateway, one worker on a tiny random Llama, three released adapters of two tenants):
a task route served by the adapter it names (``task:<name>`` and the header form), a 404 that names
nothing of another tenant, a rule by API key id, a refusal rule, the explain endpoint, and a
direct-NATS submission held to the same policy by the scheduler. Audit records and the gateway's
metrics carry the task."""

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import nats
import pytest

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import Server, free_port, start_nats, start_redis
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import decode, encode, request
from shared.schemas import (
    ApiKeyCreatedReply,
    AuditEnvelope,
    CompletionAudit,
    CreateApiKeyRequest,
    CreateTenantRequest,
    InferRequest,
    ReplyEnvelope,
    ReplyError,
    ReplyFinal,
    RouteFacts,
    SamplingParams,
    TenantsReply,
)
from tests.faults.conftest import make_adapter, release
from tests.scheduler.conftest import MODEL

WAIT_S = 60
SQL, CHAT, SECRET = "acme-sqlgen", "acme-chatter", "globex-secret"


@dataclass
class RoutingStack:
    nats: Server
    gateway_url: str
    admin_key: str  # acme's admin + inference key
    rule_key: str  # acme's second inference key, which a policy rule names by its id
    rule_key_id: str
    globex_key: str


async def _key(nc, tenant: str, scopes: list[str]) -> ApiKeyCreatedReply:
    message = CreateApiKeyRequest(tenant_id=tenant, scopes=scopes, actor="test")
    return await request(nc, subjects.registry("api_key_create"), message, ApiKeyCreatedReply, 10)


async def _tenants_and_keys(nats_url: str) -> tuple[str, ApiKeyCreatedReply, str]:
    nc = await nats.connect(nats_url)
    try:
        for tenant in ("acme", "globex"):
            await request(nc, subjects.registry("tenant_create"), CreateTenantRequest(tenant_id=tenant, actor="test"),
                          TenantsReply, 10)  # fmt: skip
        admin = await _key(nc, "acme", ["inference", "admin"])
        rule = await _key(nc, "acme", ["inference"])
        globex = await _key(nc, "globex", ["inference", "admin"])
        return admin.key, rule, globex.key
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def routed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RoutingStack]:
    root = tmp_path_factory.mktemp("routing")
    model_dir = make_tiny_model(root / MODEL)
    nats_server = start_nats(free_port(), root / "nats")
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DEV_MODE": "true",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_LIVENESS_TIMEOUT_S": "5",
        "LF_ACCEPT_TIMEOUT_S": "20",
        "LF_METRICS_PORT": "-1",
        "LF_ENGINE__MAX_NUM_SEQS": "2",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
    }
    stack = Stack(env, root / "logs")
    try:
        for name in ("registry", "scheduler", "gateway", "worker"):
            stack.start(name)
        asyncio.run(wait_ready(nats_server.url, stack, ("registry", "scheduler", "gateway"), 120))
        for adapter_id, tenant, seed in ((SQL, "acme", 5), (CHAT, "acme", 6), (SECRET, "globex", 7)):
            directory = make_adapter(model_dir, root / adapter_id, seed=seed)
            asyncio.run(release(nats_server.url, model_dir, directory, adapter_id, tenant))
        admin, rule, globex = asyncio.run(_tenants_and_keys(nats_server.url))
        yield RoutingStack(nats_server, f"http://127.0.0.1:{port}", admin, rule.key, rule.info.key_id, globex)
    finally:
        stack.stop_all()
        redis.stop()
        nats_server.stop()


@pytest.fixture
async def client(routed_stack: RoutingStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=routed_stack.gateway_url, timeout=60) as c:
        yield c


def _auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


async def _complete(client: httpx.AsyncClient, key: str, body: dict, **headers: str) -> httpx.Response:
    payload = {"prompt": "hello", "max_tokens": 2, "temperature": 0, **body}
    return await client.post("/v1/completions", json=payload, headers=_auth(key, **headers))


async def _until_ready(client: httpx.AsyncClient, key: str) -> None:
    """The worker serves (the gateway counts it ready), waited for by asking."""
    deadline = time.monotonic() + WAIT_S * 3
    while True:
        reply = await _complete(client, key, {"model": SQL})
        if reply.status_code == 200:
            return
        assert reply.status_code == 503 and time.monotonic() < deadline, reply.text
        await asyncio.sleep(0.5)


async def _routes(client: httpx.AsyncClient, s: RoutingStack) -> None:
    routes = {"text_to_sql": {"adapter": SQL}, "chat": {"adapter": CHAT, "version": 1}}
    reply = await client.put("/admin/routes", json={"routes": routes}, headers=_auth(s.admin_key))
    assert reply.status_code == 200, reply.text
    assert reply.json()["routes"]["revision"] >= 1
    secret = {"routes": {"secret_task": {"adapter": SECRET}}}
    assert (await client.put("/admin/routes", json=secret, headers=_auth(s.globex_key))).status_code == 200


async def test_a_task_is_served_by_the_adapter_its_route_names_and_a_missing_one_leaks_nothing(
    routed_stack: RoutingStack, client: httpx.AsyncClient
):
    s = routed_stack
    await _until_ready(client, s.admin_key)
    await _routes(client, s)
    named = await _complete(client, s.admin_key, {"model": "task:text_to_sql"})
    assert named.status_code == 200, named.text
    assert named.headers["x-lorafleet-adapter"] == SQL
    header = await _complete(client, s.admin_key, {}, **{"x-lorafleet-task": "chat"})  # model omitted
    assert header.status_code == 200, header.text
    assert (header.headers["x-lorafleet-adapter"], header.headers["x-lorafleet-version"]) == (CHAT, "1")
    auto = await _complete(client, s.admin_key, {"model": "auto"}, **{"x-lorafleet-task": "text_to_sql"})
    assert auto.headers["x-lorafleet-adapter"] == SQL

    models = (await client.get("/v1/models", headers=_auth(s.admin_key))).json()["data"]
    ids = {m["id"] for m in models}
    assert {"task:text_to_sql", "task:chat", SQL, CHAT} <= ids and "task:secret_task" not in ids

    missing = await _complete(client, s.admin_key, {"model": "task:secret_task"})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "task_not_found"
    listed = error["message"].split("Models you may call:")[1]  # what follows the client's own name
    assert "task:text_to_sql" in listed and SQL in listed
    assert "secret" not in listed and "globex" not in listed

    audits = await _completion_audits(s.nats.url, {named.headers["x-lorafleet-request-id"],
                                                   header.headers["x-lorafleet-request-id"]})  # fmt: skip
    assert sorted(a.task or "" for a in audits) == ["chat", "text_to_sql"]
    metrics = (await client.get("/metrics")).text
    assert 'routed_requests_total{outcome="task",route="http",task="text_to_sql"}' in metrics
    assert 'outcome="task_not_found"' in metrics


async def _completion_audits(nats_url: str, request_ids: set[str]) -> list[CompletionAudit]:
    """The completion records of ``request_ids`` on the AUDIT stream (waiting for them to be stored)."""
    nc = await nats.connect(nats_url)
    found: dict[str, CompletionAudit] = {}
    try:
        sub = await nc.jetstream().subscribe(subjects.audit("completion", "acme"), ordered_consumer=True)
        deadline = time.monotonic() + WAIT_S
        while set(found) != request_ids:
            msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            record = decode(AuditEnvelope, msg.data).body
            if isinstance(record, CompletionAudit) and record.request_id in request_ids:
                found[record.request_id] = record
    finally:
        await nc.close()
    return list(found.values())


async def test_policy_rules_by_key_and_refusal_and_explain_say_which_rule_matched(
    routed_stack: RoutingStack, client: httpx.AsyncClient
):
    s = routed_stack
    await _until_ready(client, s.admin_key)
    await _routes(client, s)
    rules = [
        {"name": "free-plan", "match": {"metadata": {"plan": "free"}}, "target": {"kind": "refuse", "message": "no"}},
        {
            "name": "by-key",
            "match": {"key_id": s.rule_key_id},
            "target": {"kind": "adapter", "adapter": {"adapter": CHAT}},
        },
    ]
    put = await client.put("/admin/policies", json={"rules": rules}, headers=_auth(s.admin_key))
    assert put.status_code == 200, put.text
    try:
        keyed = await _complete(client, s.rule_key, {"model": "task:text_to_sql"})
        assert keyed.status_code == 200, keyed.text
        assert keyed.headers["x-lorafleet-adapter"] == CHAT  # the rule, not the task route
        unkeyed = await _complete(client, s.admin_key, {"model": "task:text_to_sql"})
        assert unkeyed.headers["x-lorafleet-adapter"] == SQL

        refused = await _complete(client, s.rule_key, {"model": SQL, "metadata": {"plan": "free"}})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "route_policy_refused"

        explained = await client.get("/admin/route/explain", params={"model": "task:text_to_sql",
                                     "key_id": s.rule_key_id}, headers=_auth(s.admin_key))  # fmt: skip
        assert explained.status_code == 200, explained.text
        said = explained.json()
        assert (said["rule"], said["rule_scope"], said["adapter_id"], said["task"]) == (
            "by-key",
            "tenant",
            CHAT,
            "text_to_sql",
        )
        posted = await client.post("/admin/route/explain", json={"model": SQL, "metadata": {"plan": "free"}},
                                   headers=_auth(s.admin_key))  # fmt: skip
        assert (posted.json()["rule"], posted.json()["refused"]) == ("free-plan", "route_policy_refused")
        bad = await client.post("/admin/route/explain", json={"metadata": {"bad key": "x"}}, headers=_auth(s.admin_key))
        assert bad.status_code == 400
        foreign = await client.put("/admin/policies", json={"rules": [{"name": "steal", "target": {"kind": "adapter",
                                   "adapter": {"adapter": SECRET}}}]}, headers=_auth(s.admin_key))  # fmt: skip
        assert foreign.status_code == 404

        assert await _direct(s.nats.url, "task:text_to_sql", metadata={"plan": "free"}) == "route_policy_refused"
        # a direct client cannot claim the gateway's key: its route facts are dropped, the task route serves
        claimed = RouteFacts(key_id=s.rule_key_id)
        assert await _direct(s.nats.url, "auto", task="text_to_sql", route_facts=claimed) == SQL
    finally:
        await client.put("/admin/policies", json={"rules": []}, headers=_auth(s.admin_key))


async def _direct(nats_url: str, model: str, **fields) -> str:
    """A tenant's own submission on its subject: the adapter that served it, or the refusal's code."""
    nc = await nats.connect(nats_url)
    rid = f"direct-{uuid.uuid4().hex[:12]}"
    inbox = f"_INBOX_acme.{rid}"
    sub = await nc.subscribe(inbox)
    req = InferRequest(request_id=rid, tenant_id="acme", model=model, base_model=MODEL, prompt="hello",
                       reply_to=inbox, sampling=SamplingParams(max_tokens=2, temperature=0), **fields)  # fmt: skip
    try:
        await nc.jetstream().publish(subjects.infer_submit("acme"), encode(req))
        deadline = time.monotonic() + WAIT_S
        while True:
            body = decode(ReplyEnvelope, (await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))).data).body
            if isinstance(body, ReplyError):
                return body.error.code
            if isinstance(body, ReplyFinal):
                return body.served_by.adapter_id or ""
    finally:
        await nc.close()


def _cli(s: RoutingStack, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorafleet.cli", *argv, "--nats-url", s.nats.url], text=True,
                          capture_output=True, timeout=60, check=False)  # fmt: skip


async def test_the_cli_sets_shows_and_deletes_a_tenants_routes_and_policies(
    routed_stack: RoutingStack, client: httpx.AsyncClient, tmp_path
):
    s = routed_stack
    await _until_ready(client, s.admin_key)
    await _routes(client, s)
    assert _cli(s, "route", "set", "globex", "summarize", f"{SECRET}@1").returncode == 0
    shown = json.loads(_cli(s, "route", "show", "globex", "--json").stdout)["routes"]
    assert shown["routes"]["summarize"] == {"adapter": SECRET, "version": 1}
    assert "secret_task" in shown["routes"]  # the tenant's other routes are kept
    served = await _complete(client, s.globex_key, {"model": "task:summarize"})
    assert served.headers["x-lorafleet-adapter"] == SECRET  # the CLI's write is served at once (read-your-writes)
    foreign = _cli(s, "route", "set", "globex", "steal", SQL)
    assert foreign.returncode == 1 and "not_found" in foreign.stdout
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"name": "all-refused", "target": {"kind": "refuse", "message": "maintenance"}}]))
    assert _cli(s, "policy", "set", "--tenant", "globex", "--file", str(rules)).returncode == 0
    refused = await _complete(client, s.globex_key, {"model": "task:summarize"})
    assert refused.status_code == 403 and "maintenance" in refused.json()["error"]["message"]
    assert "all-refused" in _cli(s, "policy", "show", "--tenant", "globex").stdout
    assert _cli(s, "policy", "delete", "--tenant", "globex").returncode == 0
    assert _cli(s, "route", "delete", "globex", "summarize").returncode == 0
    gone = await _complete(client, s.globex_key, {"model": "task:summarize"})
    assert gone.status_code == 404
    actions = await _admin_audits(s.nats.url, "globex")
    expected = ["task_routes_set", "route_policies_set", "route_policies_set", "task_routes_deleted"]
    assert actions[-4:] == expected  # every change audited, in order


async def _admin_audits(nats_url: str, tenant: str) -> list[str]:
    """The actions of every admin audit record of the tenant on the AUDIT stream, oldest first."""
    nc = await nats.connect(nats_url)
    actions: list[str] = []
    try:
        js = nc.jetstream()
        subject = subjects.audit("admin", tenant)
        last = (await js.get_last_msg(subjects.AUDIT_STREAM, subject)).seq
        sub = await js.subscribe(subject, ordered_consumer=True)
        while True:
            msg = await sub.next_msg(timeout=WAIT_S)
            actions.append(getattr(decode(AuditEnvelope, msg.data).body, "action", ""))
            if msg.metadata.sequence.stream >= last:
                return actions
    finally:
        await nc.close()
