"""Hostile HTTP input to the gateway: each gets one exact OpenAI-style error (never a 5xx), changes
no state, leaves every process serving, and is audited where the platform audits the attempt."""

import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.hostile.conftest import MAX_BODY, MODEL, PICKLE, HostileStack

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**over: object) -> dict:
    return {"model": MODEL, "messages": USER, **over}


def nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def assert_error(r: httpx.Response, status: int, code: str, param: str | None) -> dict:
    """The exact status, OpenAI's error shape, the typed code and the parameter at fault."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code, error
    assert error["param"] == param or error["param"].startswith(f"{param}."), error  # e.g. stop.constrained-str
    return error


async def chunks(data: bytes, size: int = 8192) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def raw(body: object, **tokens: str) -> bytes:
    """``body`` as JSON text (lone surrogates escaped as ``\\udXXX``), each string ``"<name>"`` then replaced
    by the bare token ``tokens[name]``: what no JSON library writes, but a client can send."""
    text = json.dumps(body)
    for name, token in tokens.items():
        text = text.replace(f'"<{name}>"', token)
    return text.encode()


BODIES = [  # (path, JSON body or raw bytes, status, code, param)
    pytest.param(
        COMPLETIONS,
        raw({"model": MODEL, "prompt": "x" * MAX_BODY}),
        413,
        "payload_too_large",
        None,
        id="oversized-body",
    ),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "user", "content": nested(200)}]),
        400,
        "invalid_request",
        "messages.0.content.str",
        id="json-200-deep-in-content",
    ),
    pytest.param(CHAT, b"[" * 30_000 + b"]" * 30_000, 400, "invalid_request", None, id="json-30000-deep"),
    pytest.param(CHAT, chat(messages="hi"), 400, "invalid_request", "messages", id="messages-not-a-list"),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "user", "content": 7}]),
        400,
        "invalid_request",
        "messages.0.content.str",
        id="content-is-an-int",
    ),
    pytest.param(CHAT, chat(model=[MODEL]), 400, "invalid_request", "model", id="model-is-a-list"),
    pytest.param(
        COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 3]}, 400, "invalid_request", "prompt", id="prompt-as-token-ids"
    ),
    pytest.param(CHAT, chat(n=10**9), 400, "invalid_request", "n", id="n-1e9"),
    pytest.param(CHAT, chat(max_tokens=10**12), 400, "invalid_request", "max_tokens", id="max-tokens-1e12"),
    pytest.param(
        COMPLETIONS,
        {"model": MODEL, "prompt": "x", "max_tokens": -1},
        400,
        "invalid_request",
        "max_tokens",
        id="max-tokens-negative",
    ),
    pytest.param(
        CHAT,
        raw(chat(temperature="<nan>"), nan="NaN"),
        400,
        "invalid_request",
        "temperature",
        id="temperature-NaN-token",
    ),
    pytest.param(
        CHAT, raw(chat(top_p="<inf>"), inf="Infinity"), 400, "invalid_request", "top_p", id="top-p-Infinity-token"
    ),
    pytest.param(CHAT, chat(seed=2**64), 400, "invalid_request", "seed", id="seed-over-int64"),
    pytest.param(
        CHAT, chat(stop=[f"s{i}" for i in range(1000)]), 400, "invalid_request", "stop", id="stop-1000-strings"
    ),
    pytest.param(CHAT, chat(messages=USER * 1025), 400, "invalid_request", "messages", id="messages-1025"),
    pytest.param(
        CHAT,
        raw(chat(messages=[{"role": "user", "content": "a\ud800b"}])),
        400,
        "invalid_request",
        "messages.0.content",
        id="lone-surrogate-in-content",
    ),
    pytest.param(
        COMPLETIONS,
        raw({"model": MODEL + "\udfff", "prompt": "x"}),
        400,
        "invalid_request",
        "model",
        id="lone-surrogate-in-model",
    ),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        "invalid_request",
        "messages.0",
        id="tool-message-without-its-call-id",
    ),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        "invalid_request",
        "messages.0.role",
        id="role-unknown",
    ),
    pytest.param(
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "tenant_id": "other"}]),
        400,
        "invalid_request",
        "messages.0.tenant_id",
        id="control-field-in-message",
    ),
    *[
        pytest.param(CHAT, chat(**{name: value}), 400, "invalid_request", name, id=f"injected-{name}")
        for name, value in (
            ("tenant_id", "other"),
            ("adapter_version", 1),
            ("x-lorafleet-worker", "w1"),
            ("reply_to", "_INBOX.x"),
            ("request_id", "r1"),
            ("functions", [{"name": "f"}]),
            ("tools", [{"type": "function"}]),
        )
    ],
    pytest.param(CHAT, chat(logit_bias={"1": 1e9}), 400, "invalid_request", "logit_bias.1", id="logit-bias-huge"),
    pytest.param(
        CHAT, chat(logit_bias={"-1": 5}), 400, "invalid_request", "logit_bias.-1.[key]", id="logit-bias-negative-id"
    ),
    pytest.param(
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 7}}}),
        400,
        "invalid_json_schema",
        "response_format",
        id="json-schema-invalid",
    ),
]

MODELS = [  # names that must never resolve to anything: 404 like any unknown model
    pytest.param(MODEL + "\x00", id="nul-byte"),
    pytest.param("tiny\u200b-llama", id="zero-width-space"),
    pytest.param("\u202eterces-rehto", id="rtl-override"),
    pytest.param("../../etc/passwd", id="path-traversal"),
    pytest.param("demo-secret@../1", id="version-traversal"),
    pytest.param("demo-secret@-1", id="version-negative"),
    pytest.param("demo-secret@" + "9" * 40, id="version-huge"),
    pytest.param("demo-secret/../other-secret", id="id-traversal"),
    pytest.param("*", id="wildcard"),
]


@pytest.mark.parametrize("path, body, status, code, param", BODIES)
async def test_hostile_body_gets_a_typed_error(hostile: HostileStack, nc, path, body, status, code, param):
    before = await hostile.snapshot(nc)
    async with hostile.client(hostile.keys.demo) as c:
        if isinstance(body, bytes):
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await c.post(path, json=body)
    assert_error(r, status, code, param)
    assert await hostile.snapshot(nc) == before
    await hostile.assert_alive()


async def test_streamed_body_over_the_limit_is_413(hostile: HostileStack, nc):
    before = await hostile.snapshot(nc)
    body = raw({"model": MODEL, "prompt": "y" * 2 * MAX_BODY})
    async with hostile.client(hostile.keys.demo) as c:  # chunked: no content-length to refuse up front
        r = await c.post(COMPLETIONS, content=chunks(body), headers={"content-type": "application/json"})
    assert_error(r, 413, "payload_too_large", None)
    assert await hostile.snapshot(nc) == before


@pytest.mark.parametrize("model", MODELS)
async def test_hostile_model_names_are_unknown_models(hostile: HostileStack, nc, model):
    before = await hostile.snapshot(nc)
    async with hostile.client(hostile.keys.demo) as c:
        r = await c.post(CHAT, json=chat(model=model))
    assert_error(r, 404, "model_not_found", "model")
    assert await hostile.snapshot(nc) == before


@pytest.mark.parametrize(
    "key_name, model, headers",
    [
        pytest.param("demo", "other-secret", {}, id="foreign-adapter"),
        pytest.param("demo_admin", "other-secret@1", {}, id="foreign-adapter-pinned-preview"),
        pytest.param(
            "demo",
            "other-secret",
            {"x-lorafleet-tenant": "other", "x-tenant-id": "other", "openai-organization": "other"},
            id="tenant-header-injection",
        ),
    ],
)
async def test_foreign_adapter_is_404_like_a_missing_one_and_audited(
    hostile: HostileStack, nc, key_name, model, headers
):
    before, since = await hostile.snapshot(nc), time.time()
    async with hostile.client(getattr(hostile.keys, key_name)) as c:
        foreign = await c.post(CHAT, json=chat(model=model), headers=headers)
        missing = await c.post(CHAT, json=chat(model=model.replace("other-secret", "no-such-adapter")))
    error = assert_error(foreign, 404, "model_not_found", "model")
    assert error == {**missing.json()["error"], "message": error["message"]}
    assert error["message"] == missing.json()["error"]["message"].replace("no-such-adapter", "other-secret")
    assert await hostile.snapshot(nc) == before
    audit = await hostile.wait_audit("rejection", "demo", since, service="registry", code="tenant_isolation_attempt")
    assert "other-secret" in audit["reason"] and audit["route"] == "http"  # refused on the gateway's path
    assert hostile.audits("rejection", "other", since) == []


@pytest.mark.parametrize(
    "authorization",
    [
        pytest.param(None, id="missing"),
        pytest.param(b"Bearer \xff\xfe\x01garbled", id="garbled-bytes"),
        pytest.param(b"Bearer lf-0123456789abcdef-" + b"A" * 43, id="forged-key-format"),
        pytest.param(b"Basic a2V5LWRlbW86", id="basic-scheme"),
        pytest.param(b"Bearer key-demo\r\nX-Injected: 1", id="header-smuggling"),
        pytest.param("revoked", id="revoked-key"),
    ],
)
async def test_bad_credentials_are_401(hostile: HostileStack, nc, authorization):
    before = await hostile.snapshot(nc)
    if authorization == "revoked":
        authorization = f"Bearer {hostile.keys.revoked}".encode()
    headers = {} if authorization is None else {"authorization": authorization}
    async with hostile.client(None) as c:
        try:
            r = await c.post(CHAT, json=chat(), headers=headers)
        except httpx.LocalProtocolError:  # the client itself refuses to send a CR/LF in a header
            assert b"\r\n" in authorization
            r = await c.post(CHAT, json=chat(), headers={"authorization": authorization.split(b"\r")[0] + b"x"})
    assert_error(r, 401, "invalid_api_key", None)
    assert await hostile.snapshot(nc) == before


@pytest.mark.parametrize(
    "method, path, body",
    [
        pytest.param("post", "/admin/tenants", {"tenant_id": "evil"}, id="create-tenant"),
        pytest.param("post", "/admin/keys", {"tenant_id": "demo", "scopes": ["platform_admin"]}, id="create-key"),
        pytest.param("put", "/admin/tenants/demo/quota", {"requests_per_min": 10**6}, id="raise-own-quota"),
        pytest.param("post", "/admin/adapters/other-secret/revoke", {"version": None}, id="revoke-foreign-adapter"),
    ],
)
async def test_admin_routes_refuse_an_inference_key(hostile: HostileStack, nc, method, path, body):
    before = await hostile.snapshot(nc)
    async with hostile.client(hostile.keys.demo) as c:
        r = await c.request(method, path, json=body)
    assert_error(r, 403, "forbidden", None)
    assert await hostile.snapshot(nc) == before


@pytest.mark.parametrize(
    "form, files, status, code, param",
    [
        pytest.param(
            {"adapter_id": "pickled"},
            {"adapter_model": ("adapter_model.bin", PICKLE)},
            422,
            "integrity_error",
            None,
            id="pickle-weights",
        ),
        pytest.param(
            {"adapter_id": "traversal"},
            {"adapter_config": ("../../../etc/cron.d/x", PICKLE)},
            400,
            "invalid_request",
            None,
            id="traversal-file-name-pickle-config",
        ),
        pytest.param(
            {"adapter_id": "../../etc/passwd"}, {}, 400, "invalid_request", "adapter_id", id="traversal-adapter-id"
        ),
        pytest.param({"adapter_id": "other-secret"}, {}, 404, "not_found", "adapter_id", id="foreign-adapter-id"),
        pytest.param(
            {"adapter_id": "big"},
            {"adapter_model": ("adapter_model.safetensors", b"\0" * MAX_BODY)},
            413,
            "payload_too_large",
            None,
            id="oversized-upload",
        ),
    ],
)
async def test_hostile_adapter_push_is_refused(hostile: HostileStack, nc, form, files, status, code, param):
    before, since = await hostile.snapshot(nc), time.time()
    upload = {
        "adapter_config": ("adapter_config.json", hostile.files["adapter_config.json"]),
        "adapter_model": ("adapter_model.safetensors", hostile.files["adapter_model.safetensors"]),
        **files,
    }
    async with hostile.client(hostile.keys.demo_admin) as c:
        r = await c.post("/admin/adapters", data={"task_type": "chat", **form}, files=upload)
    assert_error(r, status, code, param)
    assert await hostile.snapshot(nc) == before
    if status in (400, 422) and param is None:  # refused by the registry's admission: audited there
        await hostile.wait_audit("rejection", "demo", since, service="registry", code=code)


@pytest.mark.parametrize(
    "method, path, status, code",
    [
        pytest.param("get", "/admin/adapters/..%2F..%2Fetc%2Fpasswd", 404, "not_found", id="encoded-slashes"),
        pytest.param("get", "/admin/adapters/%2e%2e", 400, "invalid_request", id="encoded-dot-dot"),
        pytest.param("get", "/admin/adapters/a%00b", 400, "invalid_request", id="encoded-nul"),
        pytest.param("delete", "/admin/keys/..%2f..%2fkey.0123", 404, "not_found", id="key-id-traversal"),
        pytest.param("get", "/admin/adapters?tenant=..%2Fother", 400, "invalid_request", id="tenant-query-traversal"),
        pytest.param("get", "/admin/keys?tenant=other.%3E", 400, "invalid_request", id="tenant-query-wildcard"),
        pytest.param("put", "/admin/tenants/other%0A/quota", 400, "invalid_request", id="tenant-path-newline"),
    ],
)
async def test_traversal_in_admin_paths_is_refused(hostile: HostileStack, nc, method, path, status, code):
    before = await hostile.snapshot(nc)
    async with hostile.client(hostile.keys.platform) as c:
        r = await c.request(method, path, json={} if method == "put" else None)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert await hostile.snapshot(nc) == before


async def test_gateway_still_serves_after_every_hostile_request(hostile: HostileStack):
    await hostile.assert_alive()
    async with hostile.client(hostile.keys.other) as c:
        r = await c.post(CHAT, json=chat(model="other-secret", max_tokens=2))
    assert r.status_code == 200 and r.headers["x-lorafleet-adapter"] == "other-secret"
