"""Malformed or unauthorised HTTP requests get a clear OpenAI-style error and never reach NATS."""

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.auth import ApiKeys
from services.gateway.context import GatewayContext
from services.gateway.readiness import ClusterView
from services.gateway.settings import GatewaySettings
from shared.bus import connect
from shared.catalog.view import CatalogView

KEY = "test-key-acme"


async def _never_asked(_):
    raise AssertionError("a refused request reached model resolution")


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
async def client(nats_url):
    settings = GatewaySettings(nats_url=nats_url, api_keys={KEY: "acme"}, max_body_bytes=4096)
    nc = await connect(nats_url, "test-gateway")
    ctx = GatewayContext(
        settings,
        nc,
        nc.jetstream(),
        ClusterView(5.0),
        ApiKeys(settings.api_keys),
        CatalogView(_never_asked),
    )
    transport = httpx.ASGITransport(app=create_app(ctx))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c
    await nc.close()


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


async def test_invalid_json_is_400(client):
    r = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={**AUTH, "content-type": "application/json"}
    )
    assert_openai_error(r, 400, "invalid_json")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 5}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
async def test_malformed_chat_bodies_are_400(client, body, param):
    r = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    error = assert_openai_error(r, 400)
    assert error["param"].startswith(param)


async def test_wrong_type_body_is_400(client):
    r = await client.post("/v1/completions", json=["not", "an", "object"], headers=AUTH)
    assert_openai_error(r, 400)


async def test_max_tokens_over_limit_is_400(client):
    body = {"model": "m", "prompt": "x", "max_tokens": 10_000}
    r = await client.post("/v1/completions", json=body, headers=AUTH)
    assert_openai_error(r, 400)


async def test_missing_and_wrong_keys_are_401(client):
    body = {"model": "m", "prompt": "x"}
    assert_openai_error(await client.post("/v1/completions", json=body), 401, "invalid_api_key")
    bad = {"Authorization": "Bearer nope"}
    assert_openai_error(await client.post("/v1/completions", json=body, headers=bad), 401, "invalid_api_key")


async def test_oversized_body_is_413(client):
    body = {"model": "m", "prompt": "x" * 10_000}
    assert_openai_error(await client.post("/v1/completions", json=body, headers=AUTH), 413, "payload_too_large")


async def test_missing_scheduler_is_503_at_once(client):
    body = {"model": "m", "prompt": "hello"}
    r = await client.post("/v1/completions", json=body, headers=AUTH)
    assert_openai_error(r, 503, "service_unavailable")


async def test_readyz_names_missing_pieces(client):
    r = await client.get("/readyz")
    assert r.status_code == 503
    components = r.json()["components"]
    assert components["scheduler"] == "missing"
    assert components["workers"] == "missing"
    assert (await client.get("/healthz")).status_code == 200


async def test_unknown_route_is_json_404(client):
    assert_openai_error(await client.get("/v1/nothing"), 404)
