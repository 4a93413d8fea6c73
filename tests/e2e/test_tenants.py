"""Tenants and keys from the registry, end to end on the real stack and SmolLM2: two tenants with
signed adapters, the official openai client, revocation, and cancellation freeing the worker."""

import asyncio
import sqlite3
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from lorafleet.cli.adapter_cmd import cli_connect, push_adapter
from lorafleet.cli.keys_cmd import ensure_trusted
from shared import signing, subjects
from shared.base_model import resolve_model_dir
from shared.bus import request
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import (
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    ApiKeysReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    PromoteRequest,
    RevokeApiKeyRequest,
    TenantsReply,
)
from tests.helpers.adapters import save_peft_adapter

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


async def _setup(nats_url: str, root: Path) -> dict[str, tuple[str, list[str]]]:
    """Tenants a/b with an inference key each; a owns two released signed adapters, b one."""
    base_dir = resolve_model_dir(None)
    base = LlamaForCausalLM(LlamaConfig.from_pretrained(base_dir))
    keys = signing.generate_keypair()
    key_file = root / "e2e-signer.key"
    key_file.write_bytes(keys.private_pem)
    suffix = uuid.uuid4().hex[:6]
    nc = await cli_connect(nats_url)
    out = {}
    try:
        await ensure_trusted(nc, "e2e-signer", keys.public_b64, [f"a{suffix}", f"b{suffix}"], "e2e")
        for name, count in (("a", 2), ("b", 1)):
            tenant = f"{name}{suffix}"
            await request(
                nc,
                subjects.registry("tenant_create"),
                CreateTenantRequest(tenant_id=tenant, actor="e2e"),
                TenantsReply,
                10,
            )
            created = await request(
                nc,
                subjects.registry("api_key_create"),
                CreateApiKeyRequest(tenant_id=tenant, actor="e2e"),
                ApiKeyCreatedReply,
                10,
            )
            ids = []
            for i in range(count):
                adapter_id = f"{tenant}-{i}"
                directory = save_peft_adapter(root / adapter_id, base, rank=4, seed=i)
                await push_adapter(
                    nc,
                    directory,
                    adapter_id=adapter_id,
                    tenant_id=tenant,
                    task_type="chat",
                    base_fingerprint=fingerprint_model_dir(base_dir),
                    sign_key=key_file,
                    who="e2e",
                )
                await request(
                    nc,
                    subjects.registry("promote"),
                    PromoteRequest(adapter_id=adapter_id, version=1, traffic_percent=100, actor="e2e"),
                    AdapterRecordsReply,
                    10,
                )
                ids.append(adapter_id)
            out[name] = (created.key, ids)
    finally:
        await nc.drain()
    return out


@pytest.fixture(scope="module")
def tenants(running_stack, tmp_path_factory):
    return asyncio.run(_setup(running_stack.nats.url, tmp_path_factory.mktemp("tenants")))


def oai(running_stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=key, max_retries=0)


def test_each_tenant_lists_only_its_adapters(running_stack, tenants):
    for key, ids in tenants.values():
        assert sorted(m.id for m in oai(running_stack, key).models.list().data) == sorted([MODEL, *ids])


def test_base_model_chat_and_stream_with_a_registry_key(running_stack, tenants):
    client = oai(running_stack, tenants["a"][0])
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and "Paris" in reply.choices[0].message.content
    assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.completion_tokens > 0


def test_foreign_adapter_answers_like_a_missing_one(running_stack, tenants):
    client = oai(running_stack, tenants["a"][0])
    foreign, missing = tenants["b"][1][0], "no-such-adapter-xyz"
    bodies = []
    for model in (foreign, missing):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=5)
        bodies.append(str(e.value.body).replace(model, "M"))
    assert bodies[0] == bodies[1]


def test_own_adapters_are_served(running_stack, tenants):
    key, ids = tenants["a"]
    for adapter_id in ids:
        raw = oai(running_stack, key).chat.completions.with_raw_response.create(
            model=adapter_id, messages=QUESTION, max_tokens=5, temperature=0
        )
        assert raw.headers["x-lorafleet-adapter"] == adapter_id
        assert raw.parse().usage.completion_tokens > 0


def test_revoked_key_is_401_within_a_second(running_stack, tenants):
    async def revoke(key_id: str) -> None:
        nc = await cli_connect(running_stack.nats.url)
        await request(
            nc, subjects.registry("api_key_revoke"), RevokeApiKeyRequest(key_id=key_id, actor="e2e"), ApiKeysReply, 10
        )
        await nc.drain()

    async def new_key() -> str:
        nc = await cli_connect(running_stack.nats.url)
        tenant = tenants["a"][1][0].rsplit("-", 1)[0]
        created = await request(
            nc,
            subjects.registry("api_key_create"),
            CreateApiKeyRequest(tenant_id=tenant, actor="e2e"),
            ApiKeyCreatedReply,
            10,
        )
        await nc.drain()
        return created.key

    key = asyncio.run(new_key())
    headers = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{running_stack.gateway_url}/v1/models", headers=headers).status_code == 200
    asyncio.run(revoke(key.split("-")[1]))
    revoked_at = time.monotonic()
    while httpx.get(f"{running_stack.gateway_url}/v1/models", headers=headers).status_code != 401:
        assert time.monotonic() - revoked_at < 1.0
        time.sleep(0.02)


def test_client_disconnect_frees_the_sequence_on_the_worker(running_stack, tenants):
    headers = {"Authorization": f"Bearer {tenants['a'][0]}"}
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{running_stack.gateway_url}/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        request_id = r.headers["x-lorafleet-request-id"]
        lines = r.iter_lines()
        for _ in range(8):
            next(lines)
    deadline = time.monotonic() + 15
    outcome = None
    while time.monotonic() < deadline and outcome is None:
        with sqlite3.connect(running_stack.db_path) as db:
            row = db.execute(
                "SELECT body FROM audit WHERE kind = 'completion' AND request_id = ?", (request_id,)
            ).fetchone()
        outcome = row and ('"outcome":"cancelled"' in row[0].replace(" ", ""))
        time.sleep(0.2)
    assert outcome, "the worker did not record the request as cancelled"
