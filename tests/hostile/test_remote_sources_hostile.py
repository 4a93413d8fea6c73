"""Hostile remote sources against the live stack: the registry process fetches from moto's S3 server
and an HTTPS server with a test CA. Each hostile source is refused with its typed error, changes
nothing (``snapshot``), and its refusal reaches the auditor's index; a good one is served."""

import asyncio
import hashlib
import re
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
from nats.aio.client import Client as NATS
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from shared import signing, subjects
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from shared.bus import request
from shared.errors import (
    IntegrityError,
    LorafleetError,
    SourceAddressRefused,
    SourceFileRefused,
    SourceNotAllowed,
    SourceNotApproved,
    SourceRedirectRefused,
    SourceTimeout,
    SourceTooLarge,
)
from shared.schemas import AdapterRecordsReply, AddSourceRequest, ApproveSourceRequest, RegisterRequest, SourcesReply
from tests.helpers.remote_sources import Route
from tests.hostile.conftest import PICKLE, REMOTE_MAX_FILE, REMOTE_TIMEOUT_S, Files, HostileStack

ADAPTER = "hostile-remote"


def signed_push(hostile: HostileStack, uri: str, files: Files, adapter_id: str = ADAPTER) -> RegisterRequest:
    """demo's push of ``files`` from ``uri``, signed by the "release" signer (trusted for demo)."""
    digests = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    manifest = signing.manifest_bytes(digests, adapter_id, 1, "demo", hostile.fingerprint)
    signature = signing.sign(manifest, signing.load_private_key(hostile.signer.private_pem))
    return RegisterRequest(adapter_id=adapter_id, tenant_id="demo", task_type="chat", version=1, source_uri=uri,
                           signature=signature, signer="release", actor="test")  # fmt: skip


async def allow(nc: NATS, prefix: str, tenants: list[str], private: bool = True, approval: bool = False) -> None:
    add = AddSourceRequest(
        prefix=prefix, tenants=tenants, allow_private=private, require_approval=approval, actor="test"
    )
    await request(nc, subjects.registry("source_add"), add, SourcesReply, 10)


def tampered(files: Files) -> Files:
    tensors = load_tensors(files[WEIGHTS_FILE])
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 2 + 1
    return {**files, WEIGHTS_FILE: save_tensors(tensors)}


Case = Callable[[HostileStack, NATS, str], Awaitable[str]]  # (stack, nc, a unique path) -> the source URI


async def not_listed(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.s3 is not None
    h.s3.put_dir("hostile", f"{path}/", h.files)
    await allow(nc, f"s3://hostile/{path}-listed/", ["demo"])
    return f"s3://hostile/{path}/"


async def other_tenant_only(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.s3 is not None
    h.s3.put_dir("hostile", f"{path}/", h.files)
    await allow(nc, f"s3://hostile/{path}/", ["other"])
    return f"s3://hostile/{path}/"


async def redirect_off_list(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.https is not None
    h.https.routes[f"/{path}/{CONFIG_FILE}"] = Route(status=307, location=f"https://127.0.0.1:{h.https.port}/off/x")
    await allow(nc, f"{h.https.url()}/{path}/", ["demo"])
    return f"{h.https.url()}/{path}/"


async def approved_redirecting_to_unapproved(h: HostileStack, nc: NATS, path: str) -> str:
    """An approved URL answering with a redirect to one under the same entry nobody approved (issue 47)."""
    assert h.https is not None
    h.https.routes[f"/{path}/ok/{CONFIG_FILE}"] = Route(h.files[CONFIG_FILE])
    h.https.routes[f"/{path}/ok/{WEIGHTS_FILE}"] = Route(status=302, location=f"{h.https.url()}/{path}/not-ok/w")
    h.https.routes[f"/{path}/not-ok/w"] = Route(h.files[WEIGHTS_FILE])
    await allow(nc, f"{h.https.url()}/{path}/", ["demo"], approval=True)
    approve = ApproveSourceRequest(uri=f"{h.https.url()}/{path}/ok/", actor="test")
    await request(nc, subjects.registry("source_approve"), approve, SourcesReply, 10)
    return f"{h.https.url()}/{path}/ok/"


async def oversize(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.s3 is not None
    h.s3.put_dir("hostile", f"{path}/", {**h.files, WEIGHTS_FILE: b"\0" * (REMOTE_MAX_FILE + 1)})
    await allow(nc, f"s3://hostile/{path}/", ["demo"])
    return f"s3://hostile/{path}/"


async def slow_drip(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.https is not None
    h.https.routes[f"/{path}/{CONFIG_FILE}"] = Route(h.files[CONFIG_FILE], drip_s=0.05)
    await allow(nc, f"{h.https.url()}/{path}/", ["demo"])
    return f"{h.https.url()}/{path}/"


async def internal_address(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.https is not None
    h.https.routes[f"/{path}/{CONFIG_FILE}"] = Route(h.files[CONFIG_FILE])
    await allow(nc, f"{h.https.url()}/{path}/", ["demo"], private=False)  # localhost -> 127.0.0.1
    return f"{h.https.url()}/{path}/"


async def tampered_after_signing(h: HostileStack, nc: NATS, path: str) -> str:
    assert h.s3 is not None
    h.s3.put_dir("hostile", f"{path}/", tampered(h.files))
    await allow(nc, f"s3://hostile/{path}/", ["demo"])
    return f"s3://hostile/{path}/"


def laid_out(layout: Callable[[Files], Files], suffix: str = "") -> Case:
    async def case(h: HostileStack, nc: NATS, path: str) -> str:
        assert h.s3 is not None
        h.s3.put_dir("hostile", f"{path}/", layout(h.files))
        await allow(nc, f"s3://hostile/{path}/", ["demo"])
        return f"s3://hostile/{path}/{suffix}"

    return case


CASES = [
    pytest.param(not_listed, SourceNotAllowed, "not on the registry's source allow-list", id="not-on-the-allow-list"),
    pytest.param(other_tenant_only, SourceNotAllowed, "for tenant demo", id="allowed-for-another-tenant-only"),
    pytest.param(redirect_off_list, SourceRedirectRefused, "outside tenant demo's allow-list", id="redirect-off-list"),
    pytest.param(
        approved_redirecting_to_unapproved,
        SourceNotApproved,
        "needs an operator's approval",
        id="approved-redirecting-to-unapproved",
    ),
    pytest.param(oversize, SourceTooLarge, f"{REMOTE_MAX_FILE}-byte limit", id="oversize"),
    pytest.param(slow_drip, SourceTimeout, f"within {REMOTE_TIMEOUT_S} s", id="slow-drip"),
    pytest.param(internal_address, SourceAddressRefused, "internal address 127.0.0.1", id="resolves-to-loopback"),
    pytest.param(tampered_after_signing, IntegrityError, "signature", id="tampered-after-signing"),
    pytest.param(
        laid_out(lambda f: {CONFIG_FILE: f[CONFIG_FILE], "adapter_model.bin": PICKLE}, "adapter_model.bin"),
        SourceFileRefused,
        "names a file",
        id="uri-names-a-pickle",
    ),
    pytest.param(
        laid_out(lambda f: {**f, "adapter_model.bin": PICKLE}),
        SourceFileRefused,
        "lists more than 2",
        id="pickle-beside",
    ),
    pytest.param(laid_out(lambda f: {**f, WEIGHTS_FILE: PICKLE}), IntegrityError, "header", id="pickle-as-weights"),
    pytest.param(
        laid_out(lambda f: {CONFIG_FILE: f[CONFIG_FILE], "model.py": b"import os"}),
        SourceFileRefused,
        "holds 'model.py'",
        id="code-file-instead-of-weights",
    ),
]


@pytest.mark.parametrize("case, error, text", CASES)
async def test_hostile_remote_sources_are_refused(
    hostile: HostileStack, nc: NATS, case: Case, error: type[LorafleetError], text: str
) -> None:
    uri = await case(hostile, nc, f"c-{uuid.uuid4().hex[:8]}")
    before, since, started = await hostile.snapshot(nc), time.time(), time.monotonic()
    with pytest.raises(error, match=text) as refused:
        await request(
            nc, subjects.registry("register"), signed_push(hostile, uri, hostile.files), AdapterRecordsReply, 60
        )
    assert type(refused.value) is error
    assert time.monotonic() - started < REMOTE_TIMEOUT_S + 30  # a drip is cut at the limit, not at its end
    assert await hostile.snapshot(nc) == before
    audit = await hostile.wait_audit("rejection", "demo", since, service="registry", code=error.code,
                                     request_id=f"register.{ADAPTER}")  # fmt: skip
    assert audit["reason"].startswith("push refused")
    assert hostile.stack.dead() == {}


async def test_the_admin_api_refuses_a_file_source_and_a_mixed_push(hostile: HostileStack, nc: NATS) -> None:
    before = await hostile.snapshot(nc)
    async with hostile.client(hostile.keys.demo_admin) as c:
        form = {"adapter_id": "hostile-api", "task_type": "chat"}
        local = await c.post("/admin/adapters", data={**form, "source_uri": hostile.trusted_dir.as_uri()})
        files = {"adapter_config": hostile.files[CONFIG_FILE], "adapter_model": hostile.files[WEIGHTS_FILE]}
        mixed = await c.post("/admin/adapters", data={**form, "source_uri": "s3://hostile/x/"}, files=files)
    assert (local.status_code, local.json()["error"]["param"]) == (400, "source_uri")
    assert "s3:// or https://" in local.json()["error"]["message"]
    assert (mixed.status_code, mixed.json()["error"]["param"]) == (400, "source_uri")
    assert await hostile.snapshot(nc) == before


async def test_a_signed_remote_push_through_the_admin_api_is_served(hostile: HostileStack, nc: NATS) -> None:
    """Pushed by a tenant admin over HTTP, fetched by the registry from S3, stored under demo's
    prefix, read and verified by the worker from there, and answered; another tenant gets 404."""
    assert hostile.s3 is not None
    adapter_id, path = f"remote-{uuid.uuid4().hex[:6]}", f"good-{uuid.uuid4().hex[:8]}"
    hostile.s3.put_dir("hostile", f"{path}/", hostile.files)
    await allow(nc, f"s3://hostile/{path}/", ["demo"])
    push = signed_push(hostile, f"s3://hostile/{path}/", hostile.files, adapter_id)
    async with hostile.client(hostile.keys.demo_admin) as c:
        form = {"adapter_id": adapter_id, "task_type": "chat", "source_uri": push.source_uri, "version": "1",
                "signature": push.signature, "signer": "release"}  # fmt: skip
        pushed = await c.post("/admin/adapters", data=form)
        assert pushed.status_code == 201, pushed.text
        record = pushed.json()["records"][0]
        assert re.search(
            f"/tenants/demo/{adapter_id}/1\\.[0-9a-f]{{12}}$", record["storage_uri"]
        )  # v1, the push's leaf
        assert record["origin"]["uri"] == f"s3://hostile/{path}/" and set(record["origin"]["etags"]) == {
            CONFIG_FILE,
            WEIGHTS_FILE,
        }
        promoted = await c.post(f"/admin/adapters/{adapter_id}/promote", json={"version": 1, "traffic_percent": 100})
        assert promoted.status_code == 200, promoted.text
    body = {"model": adapter_id, "prompt": "Hello", "max_tokens": 2}
    async with hostile.client(hostile.keys.demo) as c:
        served = await c.post("/v1/completions", json=body)
    assert served.status_code == 200, served.text
    async with hostile.client(hostile.keys.other) as c:
        foreign = await c.post("/v1/completions", json=body)
    assert foreign.status_code == 404


# ---- fetches in flight: bounded per tenant, refused at once, spool deleted (issue 47, MEDIUM) ----


async def test_a_push_over_the_tenants_fetch_bound_is_refused_at_once_with_retry_after(
    hostile: HostileStack, nc: NATS
) -> None:
    """demo may run one fetch at a time (LF_REMOTE__MAX_TENANT_FETCHES=1): while a dripping source
    holds it, a push through the admin API is a 429 with Retry-After at once, stores nothing and is
    audited; once the drip is cut and its spool deleted, the same push is served."""
    assert hostile.s3 is not None
    spool = hostile.trusted_dir.parent / "spool"
    held_uri = await slow_drip(hostile, nc, f"c-{uuid.uuid4().hex[:8]}")
    held_push = signed_push(hostile, held_uri, hostile.files, f"held-{uuid.uuid4().hex[:6]}")
    pushed = time.monotonic()  # the held fetch starts after this, so its time limit ends after pushed + the limit
    held = asyncio.create_task(request(nc, subjects.registry("register"), held_push, AdapterRecordsReply, 60))
    adapter_id, path = f"bounded-{uuid.uuid4().hex[:6]}", f"good-{uuid.uuid4().hex[:8]}"
    hostile.s3.put_dir("hostile", f"{path}/", hostile.files)
    await allow(nc, f"s3://hostile/{path}/", ["demo"])
    push = signed_push(hostile, f"s3://hostile/{path}/", hostile.files, adapter_id)
    form = {"adapter_id": adapter_id, "task_type": "chat", "source_uri": push.source_uri, "version": "1",
            "signature": push.signature, "signer": "release"}  # fmt: skip
    started = time.monotonic()
    while not any(spool.rglob(CONFIG_FILE)):  # the drip's fetch has begun: demo's slot is taken
        assert time.monotonic() - started < 10
        await asyncio.sleep(0.02)
    seen = time.monotonic()  # the held fetch had started by now, so its time limit ends by seen + the limit
    before, since = await hostile.snapshot(nc), time.time()
    async with hostile.client(hostile.keys.demo_admin) as c:
        asked = time.monotonic()
        busy = await c.post("/admin/adapters", data=form)
        answered = time.monotonic()
    assert busy.status_code == 429, busy.text
    assert busy.json()["error"]["code"] == "source_fetches_busy"
    # Retry-After is the held fetch's time left (at least 1 s), not a constant: within what the clocks allow
    soonest = max(1, round(REMOTE_TIMEOUT_S - (answered - pushed)))
    latest = max(1, round(REMOTE_TIMEOUT_S - (asked - seen)))
    assert soonest <= int(busy.headers["Retry-After"]) <= latest
    assert time.monotonic() - started < REMOTE_TIMEOUT_S  # refused while the drip still runs, not queued behind it
    assert await hostile.snapshot(nc) == before
    await hostile.wait_audit("rejection", "demo", since, service="registry", code="source_fetches_busy",
                             request_id=f"register.{adapter_id}")  # fmt: skip
    with pytest.raises(SourceTimeout):
        await held
    assert not any(spool.iterdir())  # the cut fetch's spool is gone
    async with hostile.client(hostile.keys.demo_admin) as c:
        served = await c.post("/admin/adapters", data=form)
    assert served.status_code == 201, served.text
    assert hostile.stack.dead() == {}
