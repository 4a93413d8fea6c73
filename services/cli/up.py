"""``lorafleet up``: NATS, Redis and the five services on this machine, a demo tenant, a working example."""

import argparse
import asyncio
import json
import secrets
import signal
from pathlib import Path

from services.cli.infra import pick_port, start_redis
from services.cli.nats_auth import start_secured_nats
from services.cli.stack import SERVICES, Stack, wait_ready


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start nats-server, redis-server and all services locally")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (busy -> a free one)")
    p.add_argument("--nats-port", type=int, default=4222)
    p.add_argument("--redis-port", type=int, default=6379)
    p.add_argument("--state-dir", type=Path, default=Path(".lorafleet"))
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every service")
    p.set_defaults(func=run)


def demo_key(state_dir: Path) -> str:
    """The demo tenant's inference key, made once and kept in the state dir."""
    path = state_dir / "demo-api-key"
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(f"lf-demo-{secrets.token_hex(16)}\n")
        path.chmod(0o600)
    return path.read_text().strip()


def example(port: int, key: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 40, "temperature": 0})
    return (f"curl -s http://127.0.0.1:{port}/v1/chat/completions \\\n"
            f"  -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\\n"
            f"  -d '{body}'")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    state = args.state_dir.resolve()
    ports = {name: pick_port(wanted) for name, wanted in
             (("gateway", args.port), ("nats", args.nats_port), ("redis", args.redis_port))}
    for name, wanted in (("gateway", args.port), ("nats", args.nats_port), ("redis", args.redis_port)):
        if ports[name] != wanted:
            print(f"port {wanted} is busy: {name} uses {ports[name]} instead")
    (state / "logs").mkdir(parents=True, exist_ok=True)
    nats, auth = start_secured_nats(ports["nats"], state, state / "logs" / "nats.log")
    redis = start_redis(ports["redis"], state / "redis", state / "logs" / "redis.log")
    key = demo_key(state)
    env = {
        "LF_NATS_URL": nats.url, "LF_REDIS_URL": redis.url, "LF_PORT": str(ports["gateway"]),
        "LF_API_KEYS": json.dumps({key: "demo"}), "LF_DB_PATH": str(state / "audit.sqlite3"),
        "LF_MODEL_CACHE": str(state / "models"),
    }
    stack = Stack(env, state / "logs")
    try:
        for name in SERVICES:
            stack.start(name, extra_env=auth.service_env(name))
        print("starting services (the first start converts the base model once, about a minute)...")
        asyncio.run(wait_ready(auth.admin_url(nats.url), stack, SERVICES, args.ready_timeout))
        print(f"\nlorafleet is up: gateway http://127.0.0.1:{ports['gateway']}  (logs: {state / 'logs'})")
        print(f"demo tenant API key: {key}\n\nTry:\n{example(ports['gateway'], key, 'SmolLM2-135M-Instruct')}\n")
        print(f"NATS requires auth: admin password in {state / 'admin.env'} "
              f"(CLI: --nats-url nats://admin:PASSWORD@127.0.0.1:{ports['nats']})")
        print("Ctrl-C stops everything.")
        signal.signal(signal.SIGTERM, _interrupt)
        while True:
            signal.pause()
    except (KeyboardInterrupt, RuntimeError, TimeoutError) as e:
        if not isinstance(e, KeyboardInterrupt):
            print(f"error: {e}")
            return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        print("stopping...")
        stack.stop_all()
        redis.stop()
        nats.stop()
    return 0
