"""compose.yaml as a newcomer meets it: `docker compose up`, the demo it seeds, the CLI inside the
image onboarding a tenant and releasing a signed adapter, the dashboard and the audit trail showing
it, and a worker container killed mid-stream (a typed end, then the worker back without a rebuild)."""

import json
import shutil
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.compose.conftest import REPO, Compose, docker, running

EXAMPLE = REPO / "lorafleet" / "demo_adapters" / "capital-answer"
ADAPTER = "acme-capital"
pytestmark = pytest.mark.timeout(3600)  # the module's first test also pays for compose up
READY_S = 1500.0


@pytest.fixture(scope="module")
def stack(lorafleet_image: str) -> Iterator[tuple[Compose, str]]:
    with running(("compose.yaml",), "lftest", READY_S) as up:
        yield up


@pytest.fixture(scope="module")
def demo_key(stack: tuple[Compose, str]) -> str:
    return stack[0].demo_key(READY_S)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_the_demo_service_releases_the_example_adapters_and_they_answer(
    stack: tuple[Compose, str], demo_key: str
) -> None:
    compose, url = stack
    printed = compose.logs("lorafleet-demo")
    assert "capital-answer answers its own task" in printed, printed
    assert f"http://127.0.0.1:{compose.env['LF_GATEWAY_PORT']}/v1/chat/completions" in printed
    reply = client(url, demo_key).chat.completions.with_raw_response.create(
        model="capital-answer",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16,
        temperature=0,
    )
    assert reply.headers["x-lorafleet-adapter"] == "capital-answer"
    assert reply.parse().choices[0].message.content


@pytest.fixture(scope="module")
def onboarded(stack: tuple[Compose, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tenant acme, an admin key, a signer trusted for it, and its signed adapter pushed with its eval set,
    evaluated by the registry on a worker and released, every step through the CLI inside the image; the key."""
    compose, _ = stack
    mine = tmp_path_factory.mktemp("my-adapter")
    shutil.copytree(EXAMPLE, mine / "capital", dirs_exist_ok=True)
    for path in (mine, *mine.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the image's user (uid 10001) reads it
    mount = [f"{mine / 'capital'}:/adapter:ro"]
    compose.cli("tenant", "create", "acme")
    key = json.loads(compose.cli("key", "create", "--tenant", "acme", "--scope", "admin", "--json"))["key"]
    compose.cli("keys", "gen", "release", "--out", "keys")
    compose.cli("keys", "trust", "release", "keys/release.pub", "--tenant", "acme")
    pushed = compose.cli(
        "adapter", "push", "/adapter/adapter", "--id", ADAPTER, "--tenant", "acme", "--task", "qa",
        "--sign-key", "keys/release.key", "--eval-set", "/adapter/eval.jsonl", volumes=mount,
    )  # fmt: skip
    assert ADAPTER in pushed
    # the release gate: the registry runs the version's own eval set on a worker before it is promoted
    compose.cli("adapter", "promote", ADAPTER, "1", "--percent", "100", timeout_s=600)
    return key


def test_the_cli_in_the_image_onboards_a_tenant_whose_signed_adapter_serves(
    stack: tuple[Compose, str], onboarded: str
) -> None:
    compose, url = stack
    reply = client(url, onboarded).chat.completions.with_raw_response.create(
        model=ADAPTER,
        messages=[{"role": "user", "content": "What is the capital of Italy?"}],
        max_tokens=12,
        temperature=0,
    )
    assert reply.headers["x-lorafleet-adapter"] == ADAPTER
    assert reply.headers["x-lorafleet-version"] == "1"
    request_id = reply.headers["x-lorafleet-request-id"]
    assert reply.parse().choices[0].message.content

    page = httpx.get(f"{url}/dashboard", timeout=30)
    assert page.status_code == 200 and "<html" in page.text.lower()
    data = httpx.get(f"{url}/dashboard/data", headers={"Authorization": f"Bearer {onboarded}"}, timeout=60)
    assert data.status_code == 200, data.text
    assert ADAPTER in data.text

    records: list[dict] = []
    deadline = time.monotonic() + 60
    while not any(r.get("kind") == "completion" for r in records) and time.monotonic() < deadline:
        out = compose.cli("audit", "query", "--request-id", request_id)
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        time.sleep(1)
    completion = next(r for r in records if r.get("kind") == "completion")
    assert completion["tenant_id"] == "acme"
    assert completion["adapter_id"] == ADAPTER and completion["adapter_version"] == 1
    assert completion.get("adapter_digest"), completion


def test_a_worker_killed_mid_stream_ends_the_stream_typed_and_comes_back(
    stack: tuple[Compose, str], demo_key: str
) -> None:
    compose, url = stack
    compose.run("stop", "worker-cpu-2")  # one worker left: the kill hits the one serving
    try:
        stream = client(url, demo_key).chat.completions.create(
            model="capital-answer",
            messages=[{"role": "user", "content": "Write a long story about a lighthouse."}],
            max_tokens=2000,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = 0
        ended: str | None = None
        try:
            for _ in stream:
                chunks += 1
                if chunks == 3:
                    docker("kill", compose.container("worker-cpu-1"))
        except openai.APIError as e:  # the typed end: an error event naming its code
            ended = str(e)
        assert chunks >= 3
        assert ended is not None or chunks >= 2000, "the stream neither ended typed nor finished"
        # docker kill counts as a manual stop (no restart policy applies): started again as an operator
        # does, the worker loads the image's prebuilt kernels and is ready without compiling
        compose.run("start", "worker-cpu-1")
        compose.wait_healthy("worker-cpu-1", 300)
        restarted = compose.logs("worker-cpu-1").split('"phase": "building_kernels"')[-1]  # the last start
        assert '"origin": "prebuilt"' in restarted or "origin=prebuilt" in restarted, restarted[-3000:]
        again = client(url, demo_key).chat.completions.create(
            model="capital-answer", messages=[{"role": "user", "content": "Capital of Spain?"}], max_tokens=8
        )
        assert again.choices[0].message.content
    finally:
        compose.run("start", "worker-cpu-2")
