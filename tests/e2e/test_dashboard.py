"""The dashboard in a real headless Chromium: it renders live charts from the running stack,
and its data route is admin-scoped. The test run leaves a screenshot in bench/results."""

import asyncio
import contextlib
import shutil
import subprocess
from pathlib import Path

import httpx
import nats
import openai

from shared import subjects
from shared.bus import request
from shared.schemas import ApiKeyCreatedReply, CreateApiKeyRequest, CreateTenantRequest, TenantsReply

SCREENSHOT = Path(__file__).resolve().parents[2] / "bench" / "results" / "dashboard.png"


async def _admin_key(nats_url: str) -> str:
    nc = await nats.connect(nats_url)
    with contextlib.suppress(Exception):  # created by an earlier test of this stack
        await request(
            nc, subjects.registry("tenant_create"), CreateTenantRequest(tenant_id="ops", actor="test"), TenantsReply, 10
        )
    reply = await request(
        nc,
        subjects.registry("api_key_create"),
        CreateApiKeyRequest(tenant_id="ops", scopes=["platform_admin"], actor="test"),
        ApiKeyCreatedReply,
        10,
    )
    await nc.close()
    return reply.key


def test_dashboard_data_is_admin_scoped(running_stack):
    inference_only = httpx.get(
        f"{running_stack.gateway_url}/dashboard/data", headers={"Authorization": f"Bearer {running_stack.api_key}"}
    )
    assert inference_only.status_code == 403
    assert httpx.get(f"{running_stack.gateway_url}/dashboard/data").status_code == 401


def test_dashboard_renders_live_charts_in_chromium(running_stack, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium package is required (make test installs it)"
    client = openai.OpenAI(base_url=f"{running_stack.gateway_url}/v1", api_key=running_stack.api_key, max_retries=0)
    for prompt in ("Hello", "What is 2+2?", "Name a colour."):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4)
    key = asyncio.run(_admin_key(running_stack.nats.url))
    data = httpx.get(
        f"{running_stack.gateway_url}/dashboard/data", headers={"Authorization": f"Bearer {key}"}, timeout=10
    ).json()
    assert data["traffic"]["requests"] >= 3 and data["workers"] and data["audit"]
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    url = f"{running_stack.gateway_url}/dashboard#key={key}"
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=6000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "live ·" in dom, dom[-2000:]
    assert dom.count("<circle") >= 3 and "demo" in dom
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile2'}",
            "--virtual-time-budget=6000",
            "--window-size=1400,1100",
            f"--screenshot={SCREENSHOT}",
            url,
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert SCREENSHOT.stat().st_size > 10_000
