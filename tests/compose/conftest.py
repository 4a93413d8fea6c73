"""The compose tier: the real image, built once, on a real Docker daemon, run as a user runs it.

``docker_host`` installs what the machine lacks (deploy/offline/docker-host.sh: Debian's docker.io,
mmdebstrap, the compose v2 plugin) and starts dockerd when none answers, stopping it, by PID, at the
end. ``lorafleet_image`` makes the base images that no registry serves here (deploy/offline/build.sh)
and builds ``lorafleet:cpu`` through compose, once for every test of the tier. Each module brings its
own project up (``Compose``) and takes it down with its volumes. Marker ``compose``: ``make test``
deselects the tier under LF_SKIP_COMPOSE=1 (``-m "not compose"``); a selected test always runs."""

import contextlib
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from lorafleet.cli.infra import free_port

REPO = Path(__file__).resolve().parents[2]
BUILD_INPUTS = REPO / "build-inputs"
TORCH = "torch==2.13.0+cpu"
DAEMON_START_S = 90.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.compose)
            item.add_marker(pytest.mark.slow)


def docker(*args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=check)


def daemon_answers() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout_s=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def docker_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    subprocess.run(["bash", str(REPO / "deploy" / "offline" / "docker-host.sh")], check=True, timeout=900)
    daemon: subprocess.Popen[bytes] | None = None
    if not daemon_answers():
        log = (tmp_path_factory.mktemp("dockerd") / "dockerd.log").open("wb")
        daemon = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + DAEMON_START_S
        while not daemon_answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.kill()
                pytest.fail(f"dockerd did not start (log: {log.name})")
            time.sleep(0.5)
    try:
        yield
    finally:
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait(10)


def _ca_bundle() -> Path | None:
    """The CA bundle pip trusts here (a TLS-intercepting proxy's CA included), for the image build."""
    for candidate in (os.environ.get("PIP_CERT"), ssl.get_default_verify_paths().cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def stage_build_inputs() -> None:
    """build-inputs/: the torch CPU wheel pip finds here (none: the build uses PyTorch's index)
    and this machine's CA bundle."""
    if not list(BUILD_INPUTS.glob("torch-2.13.0+cpu-*.whl")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                BUILD_INPUTS,
                TORCH,
            ],
            check=False,
            timeout=600,
        )
    bundle = _ca_bundle()
    if bundle is not None:
        shutil.copyfile(bundle, BUILD_INPUTS / "host-ca-bundle.crt")


@pytest.fixture(scope="session")
def lorafleet_image(docker_host: None) -> str:
    """lorafleet:cpu built through compose (base images first where no registry serves them)."""
    nats_server = Path(sys.executable).parent / "nats-server"
    subprocess.run(
        ["bash", str(REPO / "deploy" / "offline" / "build.sh")],
        check=True,
        timeout=900,
        env={**os.environ, "NATS_SERVER": str(nats_server)},
    )
    stage_build_inputs()
    Compose(("compose.yaml",), "lfimage").run("build", "lorafleet-init", timeout_s=2400)
    return "lorafleet:cpu"


@dataclass
class Compose:
    """One compose project of this test run, driven through the docker CLI as a user drives it."""

    files: Sequence[str]
    project: str
    env: dict[str, str] = field(default_factory=dict)

    def command(self, *args: str) -> list[str]:
        files = [a for f in self.files for a in ("-f", str(REPO / f))]
        return ["docker", "compose", "--project-directory", str(REPO), *files, "-p", self.project, *args]

    def run(
        self, *args: str, timeout_s: float = 600, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            input=stdin,
            timeout=timeout_s,
            env={**os.environ, **self.env},
            cwd=REPO,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done

    def cli(self, *args: str, volumes: Sequence[str] = (), timeout_s: float = 300) -> str:
        """``docker compose run --rm cli ARGS``: the lorafleet CLI inside the image; its stdout."""
        mounts = [a for v in volumes for a in ("-v", v)]
        return self.run("run", "--rm", "--no-deps", *mounts, "cli", *args, timeout_s=timeout_s).stdout

    def container(self, service: str) -> str:
        ids = self.run("ps", "-a", "-q", service).stdout.split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def state(self, service: str) -> dict:
        return json.loads(docker("inspect", "--format", "{{json .State}}", self.container(service)).stdout)

    def wait_exit(self, service: str, timeout_s: float) -> int:
        """The exit code of a one-shot service once it has run."""
        return int(docker("wait", self.container(service), timeout_s=timeout_s).stdout.strip())

    def wait_healthy(self, service: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (health := self.state(service).get("Health", {}).get("Status")) != "healthy":
            assert time.monotonic() < deadline, (
                f"{service} not healthy after {timeout_s:.0f}s: {health}\n{self.logs(service)}"
            )
            time.sleep(2)

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", "--no-log-prefix", service, check=False).stdout

    def up(self, timeout_s: float = 1500) -> None:
        self.run("up", "-d", "--quiet-pull", timeout_s=timeout_s)

    def down(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired, AssertionError):
            self.run("--profile", "cli", "down", "-v", "--remove-orphans", "--timeout", "10", timeout_s=300)

    def demo_key(self, timeout_s: float) -> str:
        """The API key the one-shot lorafleet-demo service printed, once it has run."""
        assert self.wait_exit("lorafleet-demo", timeout_s) == 0, self.logs("lorafleet-demo")
        found = re.search(r"demo tenant API key: (\S+)", self.logs("lorafleet-demo"))
        assert found, self.logs("lorafleet-demo")
        return found.group(1)


@contextlib.contextmanager
def running(
    files: Sequence[str], name: str, timeout_s: float, env: dict[str, str] | None = None
) -> Iterator[tuple[Compose, str]]:
    """A project of ``files`` up on a free gateway port until its /readyz answers 200; taken down with
    its volumes after. ``env`` sets the files' other variables. Yields it and the gateway's URL."""
    port = free_port()
    compose = Compose(files, f"{name}{os.getpid()}", {**(env or {}), "LF_GATEWAY_PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    try:
        compose.up(timeout_s)
        wait_ready(url, timeout_s)
        yield compose, url
    finally:
        compose.down()


def wait_ready(url: str, timeout_s: float) -> dict:
    """GET /readyz until it answers 200; its last body."""
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            reply = httpx.get(f"{url}/readyz", timeout=10)
            body = reply.json()
            if reply.status_code == 200:
                return body
        time.sleep(2)
    raise AssertionError(f"{url}/readyz not ready after {timeout_s:.0f}s: {body}")
