"""The secured stack (``lorafleet up``'s permission model: one NATS user per service and per worker,
tenant users) on the tiny model: both workers serve through their own users, and the README's two
direct-NATS programs run as printed, each tenant seeing only its own audit records."""

import asyncio
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest

from bench.tiny_model import make_tiny_model
from lorafleet.cli import nats_snippets
from lorafleet.cli.infra import Server, free_port, start_redis
from lorafleet.cli.nats_accounts import users_of
from lorafleet.cli.nats_auth import LocalAuth, start_secured_nats
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import connect
from tests.scheduler.conftest import wait_workers

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"
WORKERS = ("w1", "w2")
TENANTS = ("acme", "globex")
API_KEY = "key-acme"


@dataclass
class SecuredStack:
    stack: Stack
    nats: Server
    auth: LocalAuth
    gateway_url: str
    nats_log: Path

    def tenant_env(self, tenant: str) -> dict[str, str]:
        exported = nats_snippets.tenant_env(self.nats.url, tenant, self.auth.tenant_password(tenant))
        return {
            **os.environ,
            **dict(kv.split("=", 1) for kv in exported.removeprefix("export ").split()),
            "LF_MODEL": MODEL,
        }


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredStack]:
    root = tmp_path_factory.mktemp("secured")
    model_dir = make_tiny_model(root / MODEL)
    (root / "logs").mkdir()
    nats, auth = start_secured_nats(free_port(), root / "state", root / "logs" / "nats.log", WORKERS, TENANTS)
    redis = start_redis(free_port(), root / "redis")
    port = free_port()
    env = {
        "LF_NATS_URL": nats.url,
        "LF_REDIS_URL": redis.url,
        "LF_PORT": str(port),
        "LF_API_KEYS": json.dumps({API_KEY: "acme"}),
        "LF_MODEL_DIR": str(model_dir),
        "LF_DB_PATH": str(root / "audit.db"),
        "LF_LIVENESS_TIMEOUT_S": "5",
        "LF_ACCEPT_TIMEOUT_S": "10",
        "LF_ENGINE__MAX_NUM_SEQS": "4",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
    }
    stack = Stack(env, root / "logs")
    running = SecuredStack(stack, nats, auth, f"http://127.0.0.1:{port}", root / "logs" / "nats.log")
    try:
        for name in ("registry", "auditor", "scheduler", "gateway"):
            stack.start(name, extra_env=auth.service_env(name))
        for worker in WORKERS:
            stack.start("worker", extra_env=auth.worker_env(worker), key=worker)
        admin = auth.admin_url(nats.url)
        asyncio.run(wait_ready(admin, stack, ("registry", "auditor", "scheduler", "gateway"), 180))
        asyncio.run(wait_workers(admin, set(WORKERS), 180))
        yield running
    finally:
        stack.stop_all(timeout_s=5)
        redis.stop()
        nats.stop()


def readme_programs() -> list[str]:
    """The python blocks of the README's "Use NATS directly" section, as printed."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Use NATS directly") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run_program(source: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout_s)


def violations(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "violation" in line.lower()]


def test_the_readme_shows_exactly_what_user_create_prints(tmp_path: Path) -> None:
    assert readme_programs() == [nats_snippets.SUBMIT, nats_snippets.FOLLOW_AUDIT]
    done = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli.nats_auth", "user", "create", "--tenant", "acme", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    assert nats_snippets.SUBMIT in done.stdout and nats_snippets.FOLLOW_AUDIT in done.stdout
    password = re.search(r"^password: (\S+)$", done.stdout, re.M)
    conf = json.loads((tmp_path / "nats.conf").read_text())
    users = {name: u["password"] for name, u in users_of(conf).items()}
    assert password and users["tenant-acme"] == password.group(1)
    assert f"LF_TENANT=acme LF_NATS_PASSWORD={password.group(1)}" in done.stdout


def test_every_worker_serves_through_its_own_nats_user(secured: SecuredStack) -> None:
    served: set[str] = set()
    with httpx.Client(base_url=secured.gateway_url, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        for i in range(8):
            r = client.post(
                "/v1/completions", json={"model": MODEL, "prompt": f"count {i}", "max_tokens": 4}, timeout=60
            )
            assert r.status_code == 200, r.text
            served.add(r.headers["x-lorafleet-worker"])
    assert served and served <= set(WORKERS)
    assert violations(secured.nats_log) == []  # no worker needed a subject its own user lacks


def test_the_readme_submit_program_streams_a_reply(secured: SecuredStack) -> None:
    submit = readme_programs()[0]
    done = run_program(submit, secured.tenant_env("acme"))
    assert done.returncode == 0, done.stderr
    assert re.search(r"\n\[(length|stop), \d+ tokens\]\n$", done.stdout), done.stdout
    violations_before = violations(secured.nats_log)
    assert violations_before == [], violations_before


def _until_completion(stream: IO[str]) -> str:
    """The lines a follower prints, up to and including its first completion record (or its end)."""
    out = ""
    for line in stream:
        out += line
        if " completion " in line:
            break
    return out


def _follow_lines(out: str) -> list[tuple[str, str]]:
    """(subject, kind) of each record the follow program printed."""
    return [(fields[0], fields[1]) for fields in (line.split(" ") for line in out.splitlines() if line)]


def test_a_tenant_follows_only_its_own_audit_records_live_and_replayed(secured: SecuredStack) -> None:
    submit, follow = readme_programs()
    for tenant in ("globex", "acme", "globex"):
        assert run_program(submit, secured.tenant_env(tenant)).returncode == 0
    asyncio.run(_until_audited(secured, {"acme": 1, "globex": 2}))

    replay = run_program(follow, {**secured.tenant_env("acme"), "LF_FOLLOW_SECONDS": "0"})
    assert replay.returncode == 0, replay.stderr
    replayed = _follow_lines(replay.stdout)
    assert [kind for _, kind in replayed].count("completion") >= 1
    assert {subject for subject, _ in replayed} <= {subjects.audit(k, "acme") for k in ("completion", "rejection")}

    env = {**secured.tenant_env("acme"), "LF_FOLLOW_SECONDS": "60"}
    live = subprocess.Popen([sys.executable, "-c", follow], env=env, stdout=subprocess.PIPE, text=True)
    out, reader = "", concurrent.futures.ThreadPoolExecutor(1)
    try:
        time.sleep(3)  # past its replay (nothing new: the run above acknowledged it) and into the live part
        for tenant in ("globex", "acme"):
            assert run_program(submit, secured.tenant_env(tenant)).returncode == 0
        asyncio.run(_until_audited(secured, {"acme": 2, "globex": 3}))
        assert live.stdout is not None
        # the follower prints each record as it comes (flushed): read up to acme's new completion, bounded
        out = reader.submit(_until_completion, live.stdout).result(timeout=60)
    finally:
        live.terminate()
        out += live.communicate(timeout=30)[0]
        reader.shutdown()
    lines = _follow_lines(out)
    assert [kind for _, kind in lines].count("completion") >= 1
    assert all(subject.endswith(".acme") for subject, _ in lines), lines


async def _until_audited(secured: SecuredStack, completions: dict[str, int], timeout_s: float = 30) -> None:
    """Wait until the AUDIT stream holds at least this many completion records per tenant."""
    nc = await connect(secured.auth.admin_url(secured.nats.url), "test-audit-count")
    js = nc.jetstream(timeout=5)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            info = await js.stream_info(subjects.AUDIT_STREAM, subjects_filter=subjects.AUDIT_COMPLETION_ALL)
            held = info.state.subjects or {}
            if all(held.get(subjects.audit("completion", t), 0) >= n for t, n in completions.items()):
                return
            assert time.monotonic() < deadline, held
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
