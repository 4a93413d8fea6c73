"""``lorafleet up``: NATS, Redis and the five services on this machine, a demo tenant, a working example."""

import argparse
import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from lorafleet.cli.demo_cmd import seed_demo
from lorafleet.cli.demo_tenant import DEMO_TENANT
from lorafleet.cli.infra import Server, cluster_url, pick_port, sentinel_addresses, start_redis, start_sentinels
from lorafleet.cli.nats_auth import LocalAuth, start_secured_nats, start_secured_nats_cluster
from lorafleet.cli.nats_snippets import tenant_env
from lorafleet.cli.stack import SERVICES, Stack, wait_ready
from lorafleet.cli.supervisor import Child, Supervisor, supervise
from shared.env_names import UnknownVariables, check_environment
from shared.errors import LorafleetError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start nats-server, redis-server and all services locally")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (busy -> a free one)")
    p.add_argument("--nats-port", type=int, default=4222)
    p.add_argument("--redis-port", type=int, default=6379)
    p.add_argument("--state-dir", type=Path, default=Path(".lorafleet"))
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every service")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="a 3-node NATS cluster (ports --nats-port and the next two) with every stream, KV bucket and "
        "object store at replicas 3, instead of one nats-server; and Redis with a replica and 3 sentinels "
        "(ports --redis-port and the next one, --sentinel-port and the next two) that fail it over",
    )
    p.add_argument("--sentinel-port", type=int, default=26379, help="first Redis Sentinel port (with --cluster)")
    p.set_defaults(func=run)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def start_redis_set(
    cluster: bool, redis_port: int, sentinel_port: int, state: Path
) -> tuple[list[Server], dict[str, str]]:
    """redis-server alone, or (``cluster``) a master, its replica and three sentinels watching them
    (master name ``lorafleet``); the servers and the LF_REDIS_* environment that reaches them."""
    logs = state / "logs"
    master = start_redis(redis_port, state / "redis", logs / "redis.log")
    env = {"LF_REDIS_URL": master.url}
    if not cluster:
        return [master], env
    replica = start_redis(
        pick_port(redis_port + 1), state / "redis-replica", logs / "redis-replica.log", replicaof=master
    )
    ports = [pick_port(sentinel_port + i) for i in range(3)]
    sentinels = start_sentinels(ports, master, state / "sentinels", logs, "lorafleet")
    env |= {"LF_REDIS_SENTINELS": sentinel_addresses(sentinels), "LF_REDIS_SENTINEL_MASTER": "lorafleet"}
    return [master, replica, *sentinels], env


def _children(stack: Stack, nodes: list[Server], redis: list[Server], auth: LocalAuth) -> list[Child]:
    """nats-server (each node of a cluster), redis-server (and its replica and sentinels) and each
    service, as the supervisor restarts them."""
    children = [
        Child("nats" if len(nodes) == 1 else node.name, lambda node=node: node.proc, node.start, node.log_file)  # type: ignore[misc]
        for node in nodes
    ]
    children.extend(
        Child(server.name, lambda server=server: server.proc, server.start, server.log_file)  # type: ignore[misc]
        for server in redis
    )
    children.extend(
        Child(
            name,
            lambda name=name: stack.procs[name],  # type: ignore[misc]
            lambda name=name: stack.start(name, extra_env=auth.service_env(name)),  # type: ignore[misc]
            stack.log_dir / f"{name}.log",
        )
        for name in SERVICES
    )
    return children


def _say_to(log_file: Path) -> Callable[[str], None]:
    def say(line: str) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
        print(stamped, flush=True)
        with open(log_file, "a") as f:
            f.write(stamped + "\n")

    return say


def run(args: argparse.Namespace) -> int:
    try:  # every service would refuse it: say so once, before anything starts
        check_environment(os.environ)
    except UnknownVariables as e:
        print(f"invalid configuration: {e}")
        return 1
    state = args.state_dir.resolve()
    ports = {
        name: pick_port(wanted)
        for name, wanted in (("gateway", args.port), ("nats", args.nats_port), ("redis", args.redis_port))
    }
    for name, wanted in (("gateway", args.port), ("nats", args.nats_port), ("redis", args.redis_port)):
        if ports[name] != wanted:
            print(f"port {wanted} is busy: {name} uses {ports[name]} instead")
    (state / "logs").mkdir(parents=True, exist_ok=True)
    # SIGTERM stops everything as Ctrl-C does, from the first process started on. (A launcher that
    # starts `up` in the background may leave SIGINT ignored; SIGTERM is the signal that always reaches it.)
    signal.signal(signal.SIGTERM, _interrupt)
    nodes: list[Server] = []
    redis: list[Server] = []
    stack: Stack | None = None
    try:
        if args.cluster:
            node_ports = [ports["nats"], *(pick_port(ports["nats"] + i) for i in (1, 2))]
            nodes, auth = start_secured_nats_cluster(node_ports, state, state / "logs", tenants=(DEMO_TENANT,))
            print(f"NATS cluster of {len(nodes)} nodes on ports {', '.join(map(str, node_ports))} (replicas 3)")
        else:
            nats, auth = start_secured_nats(ports["nats"], state, state / "logs" / "nats.log", tenants=(DEMO_TENANT,))
            nodes = [nats]
        nats_url = cluster_url(nodes)
        redis, redis_env = start_redis_set(args.cluster, ports["redis"], args.sentinel_port, state)
        if args.cluster:
            print(
                f"Redis {redis[0].port} with replica {redis[1].port}, sentinels on {', '.join(str(s.port) for s in redis[2:])}"
            )
        env = {
            "LF_NATS_URL": nats_url,
            "LF_JETSTREAM_REPLICAS": str(len(nodes)),
            **redis_env,
            "LF_PORT": str(ports["gateway"]),
            "LF_DB_PATH": str(state / "audit.sqlite3"),
            "LF_MODEL_CACHE": str(state / "models"),
        }
        stack = Stack(env, state / "logs")
        model_dir = os.environ.get("LF_MODEL_DIR") or None  # the services read the same variable
        for name in SERVICES:
            stack.start(name, extra_env=auth.service_env(name))
        if model_dir:
            print(f"starting services on the base model in {model_dir}...")
        else:
            print("starting services (the first start converts the base model once, about a minute)...")
        asyncio.run(wait_ready(auth.admin_url(nats_url), stack, SERVICES, args.ready_timeout))
        print(f"\nlorafleet is up: gateway http://127.0.0.1:{ports['gateway']}  (logs: {state / 'logs'})")
        seed_demo(
            auth.admin_url(nats_url),
            f"http://127.0.0.1:{ports['gateway']}",
            ports["gateway"],
            state,
            model_dir,
            state / "models",
        )
        print(
            f"NATS requires auth: admin password in {state / 'admin.env'} "
            f"(CLI: --nats-url nats://admin:PASSWORD@127.0.0.1:{ports['nats']})"
        )
        print(
            f"direct NATS as the demo tenant (README, 'Use NATS directly'; one NATS user per worker):\n"
            f"  {tenant_env(nats_url, DEMO_TENANT, auth.tenant_password(DEMO_TENANT))}"
        )
        print(
            f"every process is supervised: one that exits is restarted with backoff "
            f"(log: {state / 'logs' / 'supervisor.log'}; pids: {state / 'processes.json'})"
        )
        print("Ctrl-C stops everything.")
        supervisor = Supervisor(_children(stack, nodes, redis, auth), say=_say_to(state / "logs" / "supervisor.log"))
        asyncio.run(supervise(supervisor, auth.admin_url(nats_url), state / "processes.json"))
    except (KeyboardInterrupt, RuntimeError, TimeoutError, LorafleetError) as e:
        if not isinstance(e, KeyboardInterrupt):
            print(f"error: {e}")
            return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        print("stopping...")
        if stack is not None:
            stack.stop_all()
        for server in reversed(redis):
            server.stop()
        for node in nodes:
            node.stop()
    return 0
