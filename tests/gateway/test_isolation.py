"""Tenant A cannot list, call, manage or learn of tenant B's adapters: every route answers a
foreign adapter exactly like a missing one."""

import uuid

import openai
import pytest

from tests.gateway.adapters import make_adapter, release
from tests.gateway.conftest import BASE


@pytest.fixture
async def two_tenants(gateway, tmp_path):
    """Tenant a owns adapters a-1 and a-2; tenant b owns b-1; both have admin+inference keys."""
    suffix = uuid.uuid4().hex[:6]
    out = {}
    for name, count in (("a", 2), ("b", 1)):
        tenant, key = await gateway.tenant(f"{name}{suffix}", scopes=("admin", "inference"))
        async with gateway.client(key) as c:
            ids = [f"{name}{suffix}-{i}" for i in range(1, count + 1)]
            for i, adapter_id in enumerate(ids):
                await release(c, make_adapter(tmp_path / adapter_id, seed=i), adapter_id)
        out[name] = (tenant, key, ids)
    return out


def oai(gateway, key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


async def test_models_lists_only_own_adapters_and_base(gateway, two_tenants):
    for _, key, ids in two_tenants.values():
        models = await oai(gateway, key).models.list()
        assert sorted(m.id for m in models.data) == sorted([BASE, *ids])


async def test_own_adapter_is_served_with_its_headers(gateway, two_tenants):
    _, key, ids = two_tenants["a"]
    raw = await oai(gateway, key).chat.completions.with_raw_response.create(
        model=ids[1], messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-lorafleet-adapter"] == ids[1] and raw.headers["x-lorafleet-version"] == "1"
    assert raw.headers["x-lorafleet-cache-hit"] == "true"
    assert f'"adapter": "{ids[1]}"' in raw.parse().choices[0].message.content
    pinned = await oai(gateway, key).completions.create(model=f"{ids[0]}@1", prompt="hi")
    assert f'"adapter": "{ids[0]}"' in pinned.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
async def test_no_cache_hit_header_where_the_worker_did_not_tell(gateway, two_tenants, stream):
    """Issue 47: a worker tells no cache hit for an adapter the tenant does not own (its residency is
    other tenants' traffic); the gateway then sends no header rather than a guess."""
    _, key, ids = two_tenants["a"]
    raw = await oai(gateway, key).chat.completions.with_raw_response.create(
        model=ids[0], messages=[{"role": "user", "content": "untold-hit"}], stream=stream
    )
    assert raw.headers["x-lorafleet-adapter"] == ids[0]
    assert "x-lorafleet-cache-hit" not in raw.headers


async def test_retrieve_model_answers_own_models_and_base(gateway, two_tenants):
    _, key, ids = two_tenants["a"]
    client = oai(gateway, key)
    for model in (BASE, ids[0], f"{ids[1]}@1"):
        found = await client.models.retrieve(model)
        assert found.id == model and found.object == "model"
    assert (await client.models.retrieve(ids[0])).owned_by == two_tenants["a"][0]
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve(f"{ids[0]}@7")


async def test_retrieve_model_with_a_long_name_is_a_typed_4xx(gateway, two_tenants):
    _, key, _ = two_tenants["a"]
    async with gateway.client(key) as c:
        near_limit = await c.get(f"/v1/models/{'m' * 250}")  # a valid length: "retrieve:" + it once overflowed
        too_long = await c.get(f"/v1/models/{'m' * 300}")
    assert near_limit.status_code == 404 and near_limit.json()["error"]["code"] == "model_not_found"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "invalid_request"
    assert too_long.json()["error"]["param"] == "model"


INFERENCE = [
    ("get", "/v1/models/{m}", None),
    ("post", "/v1/chat/completions", lambda m: {"model": m, "messages": [{"role": "user", "content": "x"}]}),
    ("post", "/v1/chat/completions", lambda m: {"model": f"{m}@1", "messages": [{"role": "user", "content": "x"}]}),
    ("post", "/v1/completions", lambda m: {"model": m, "prompt": "x", "stream": True}),
]
ADMIN = [
    ("get", "/admin/adapters/{m}", None),
    ("post", "/admin/adapters/{m}/promote", {"version": 1, "traffic_percent": 50}),
    ("post", "/admin/adapters/{m}/rollout", {"traffic_percent": 50}),
    ("post", "/admin/adapters/{m}/rollback", None),
    ("post", "/admin/adapters/{m}/retire", {"version": 1}),
    ("post", "/admin/adapters/{m}/revoke", {"version": None}),
    ("get", "/admin/adapters/{m}/pins", None),
    ("post", "/admin/adapters/{m}/pin", None),
    ("post", "/admin/adapters/{m}/pin", {"worker": "w1", "version": 1}),
    ("post", "/admin/adapters/{m}/unpin", {}),
]


async def test_foreign_adapter_is_indistinguishable_from_a_missing_one(gateway, two_tenants):
    _, key, _ = two_tenants["a"]
    foreign = two_tenants["b"][2][0]
    missing = f"nothing-{uuid.uuid4().hex[:8]}"
    async with gateway.client(key) as c:
        for method, path, body in INFERENCE:
            answers = [await c.request(method, path.format(m=m), json=body and body(m)) for m in (foreign, missing)]
            assert [a.status_code for a in answers] == [404, 404]
            assert answers[0].text.replace(foreign, "M") == answers[1].text.replace(missing, "M")
        for method, path, body in ADMIN:
            answers = [await c.request(method, path.format(m=m), json=body) for m in (foreign, missing)]
            assert [a.status_code for a in answers] == [404, 404], answers[0].text
            assert answers[0].text.replace(foreign, "M") == answers[1].text.replace(missing, "M")
        listed = (await c.get("/admin/adapters")).json()["records"]
        assert foreign not in {r["adapter_id"] for r in listed}
        assert (await c.get("/admin/adapters", params={"tenant": two_tenants["b"][0]})).status_code == 404


async def test_pushing_onto_a_foreign_adapter_id_is_404(gateway, two_tenants, tmp_path):
    from tests.gateway.adapters import push

    _, key, _ = two_tenants["a"]
    foreign = two_tenants["b"][2][0]
    async with gateway.client(key) as c:
        r = await push(c, make_adapter(tmp_path / "x"), foreign)
    assert r.status_code == 404


async def test_foreign_tenant_keys_and_tenants_are_hidden(gateway, two_tenants):
    _, key, _ = two_tenants["a"]
    b_tenant = two_tenants["b"][0]
    async with gateway.client(key) as c:
        assert (await c.get("/admin/keys", params={"tenant": b_tenant})).status_code == 404
        assert (await c.get("/admin/tenants", params={"tenant": b_tenant})).status_code == 404
        assert (await c.post("/admin/keys", json={"tenant_id": b_tenant})).status_code == 404
        b_key_id = two_tenants["b"][1].split("-")[1]
        assert (await c.delete(f"/admin/keys/{b_key_id}")).status_code == 404
        assert (await c.post("/admin/tenants", json={"tenant_id": "evil"})).status_code == 403
        assert (await c.post("/admin/keys", json={"scopes": ["platform_admin"]})).status_code == 403
    async with gateway.client(two_tenants["b"][1]) as c:
        assert (await c.get("/v1/models")).status_code == 200
