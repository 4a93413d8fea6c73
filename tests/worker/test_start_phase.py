"""A worker names its way to serving: while another process builds the native kernels it waits in
``building_kernels``, and its heartbeat, the gateway's /readyz and the healthcheck say so; once the
build is there it loads it (no build of its own) and goes on through loading_model and warming to
ready, one ``worker_phase`` log line per phase."""

import asyncio
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.tiny_model import make_tiny_model
from kernels import native, native_build
from lorafleet.cli.infra import free_port
from lorafleet.cli.stack import Stack
from shared import subjects
from shared.bus import connect, decode
from shared.schemas import ServiceHeartbeat
from tests.helpers.native import needs_toolchain

pytestmark = [pytest.mark.slow, needs_toolchain]
WORKER = "phase-w1"


@pytest.fixture
def stack(tmp_path: Path, nats_url: str, redis_url: str, smollm_dir: Path) -> Iterator[tuple[Stack, int]]:
    port = free_port()
    env = {
        "LF_NATS_URL": nats_url,
        "LF_REDIS_URL": redis_url,
        "LF_PORT": str(port),
        "LF_MODEL_DIR": str(make_tiny_model(tmp_path / "tiny-llama")),
        "LF_WORKER_ID": WORKER,
        "LF_KERNELS_DIR": str(tmp_path / "kernels"),
        "LF_KERNELS_BUILD_TIMEOUT_S": "300",
        "LF_HEARTBEAT_INTERVAL_S": "0.2",
        "LF_REQUIRE_SIGNATURE": "false",
        "LF_ENGINE__NUM_THREADS": "1",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
        "LF_REDIS_KEY_PREFIX": "phase:",
    }
    running = Stack(env, tmp_path / "logs")
    yield running, port
    running.stop_all()


async def first_beat(nats_url: str, phase: str, timeout_s: float) -> ServiceHeartbeat:
    """The worker's first service heartbeat in ``phase``."""
    nc = await connect(nats_url, "test-phase")
    seen: asyncio.Future[ServiceHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_beat(msg) -> None:
        beat = decode(ServiceHeartbeat, msg.data)
        if beat.instance_id == WORKER and beat.phase == phase and not seen.done():
            seen.set_result(beat)

    try:
        await nc.subscribe(subjects.service_heartbeat("worker"), cb=on_beat)
        return await asyncio.wait_for(seen, timeout_s)
    finally:
        await nc.close()


def readyz(port: int, workers: str, timeout_s: float) -> dict[str, str]:
    """/readyz's components once the gateway answers and its ``workers`` entry holds ``workers``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            components = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).json()["components"]
            if workers in components.get("workers", ""):
                return components
        except (httpx.HTTPError, ValueError):
            pass  # the gateway is still starting
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway's /readyz never said {workers!r} of the workers")
        time.sleep(0.2)


def test_a_worker_waiting_on_a_kernel_build_says_so_then_serves_with_it(
    stack: tuple[Stack, int], nats_url: str, tmp_path: Path
) -> None:
    running, port = stack
    assert native.built()  # this session's build (tests/conftest.py), handed over below as another builder's
    built = native_build.library()
    name = native_build.extension_name()
    cache = tmp_path / "kernels"
    cache.mkdir()
    with (cache / f"{name}.lock").open("a") as builder:  # another process is building
        fcntl.flock(builder, fcntl.LOCK_EX)
        running.start("worker")
        running.start("gateway")
        beat = asyncio.run(first_beat(nats_url, "building_kernels", 120))
        assert not beat.ready and beat.detail.startswith("building_kernels")
        components = readyz(port, WORKER, 120)
        assert components["workers"].startswith(f"not ready: {WORKER} building_kernels (")
        probe = subprocess.run(
            [sys.executable, "-m", "lorafleet.cli.healthcheck", "worker", "--timeout", "2"],
            env={**os.environ, **running.env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 1 and f"not ready: {WORKER} building_kernels" in probe.stdout, probe.stdout
        (cache / name).mkdir(exist_ok=True)  # the other builder finishes: its library and record, then its flock goes
        shutil.copy(built.path, cache / name / built.path.name)
        shutil.copy(built.path.parent / native_build.RECORD, cache / name / native_build.RECORD)
    asyncio.run(first_beat(nats_url, "ready", 120))
    assert readyz(port, "1 ready", 30)["workers"] == "1 ready"
    log = (running.log_dir / "worker.log").read_text()
    phases = [json.loads(line)["phase"] for line in log.splitlines() if '"worker_phase"' in line]
    assert phases == ["building_kernels", "loading_model", "warming", "ready"]
    assert '"origin": "cache"' in log and not (cache / name / "build.log").exists()  # loaded, never built here
