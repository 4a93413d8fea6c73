"""Time to first token through direct NATS (README, "Use NATS directly"), with each tenant in its own NATS
account (issue 47) and as before, with every user in the platform's account, in one run on one stack.

``python -m bench.direct_nats [--requests N] [--rounds R]`` starts nats-server with the generated
permission model, redis-server, and the registry, auditor, scheduler and one worker on the tiny model.
A tenant client submits as the README's program does (a JetStream publish on its submit subject, the
reply on its own inbox) one request at a time, and times the publish to the first token. Between rounds
nats-server restarts on its port and store with the other config (the services reconnect; JetStream
stays in the platform's account either way), alternating accounts / one account so that drift falls on
both. What differs is the path of the submission (a service import, its reply mapped back) and of the
tokens (a stream import of the tenant's inbox). Writes bench/results/direct_nats.json and .md.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import nats

from bench.tiny_model import make_tiny_model
from lorafleet.cli.infra import free_port, start_redis
from lorafleet.cli.nats_accounts import PLATFORM, users_of
from lorafleet.cli.nats_auth import LocalAuth, start_secured_nats, write_private
from lorafleet.cli.nats_permissions import tenant_user
from lorafleet.cli.stack import Stack, wait_ready
from shared import subjects
from shared.bus import connect, decode
from shared.schemas import WorkerHeartbeat

RESULTS = Path(__file__).parent / "results"
TENANT, WORKER, MODEL = "acme", "w1", "tiny-llama"
MODES = ("accounts", "one-account")


def one_account(conf: dict) -> dict:
    """The model before issue 47: every user, tenants and the SIEM included, in the platform's account
    (with the same allow lists), and nothing imported or exported."""
    flat = {k: v for k, v in conf.items() if k != "accounts"}
    flat["accounts"] = {PLATFORM: {"jetstream": "enabled", "users": list(users_of(conf).values())}}
    return flat


async def _ready_worker(admin_url: str, timeout_s: float) -> None:
    nc = await connect(admin_url, "bench-fleet")
    try:
        sub = await nc.subscribe(subjects.WORKER_HEARTBEAT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            beat = decode(WorkerHeartbeat, (await sub.next_msg(timeout=timeout_s)).data)
            if beat.ready:
                return
        raise TimeoutError("the worker is not ready")
    finally:
        await nc.close()


async def _ttft(url: str, auth: LocalAuth, max_tokens: int) -> float:
    """One request as the README's submit program sends it: ms from the publish to the first token."""
    nc = await nats.connect(
        url,
        user=tenant_user(TENANT),
        password=auth.tenant_password(TENANT),
        inbox_prefix=subjects.tenant_inbox(TENANT),
    )
    try:
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        request = {
            "request_id": str(uuid.uuid4()),
            "tenant_id": TENANT,
            "model": MODEL,
            "base_model": MODEL,
            "prompt": "The capital of France is",
            "sampling": {"max_tokens": max_tokens, "temperature": 0},
            "reply_to": inbox,
        }
        start = time.perf_counter()
        await nc.jetstream().publish(subjects.infer_submit(TENANT), json.dumps(request).encode())
        first = None
        while True:
            body = json.loads((await replies.next_msg(timeout=60)).data)["body"]
            if body["kind"] == "token" and first is None:
                first = (time.perf_counter() - start) * 1000
            elif body["kind"] == "error":
                raise RuntimeError(body["error"])
            elif body["kind"] == "final":
                assert first is not None, "a final before any token"
                return first
    finally:
        await nc.close()


async def _settle(url: str, auth: LocalAuth, timeout_s: float = 120) -> None:
    """Return once a request is served again after a restart of nats-server (services reconnected)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await asyncio.wait_for(_ttft(url, auth, 2), 20)
            return
        except (TimeoutError, nats.errors.Error, RuntimeError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


def run(requests: int, rounds: int, max_tokens: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lf-direct-nats-"))
    model_dir = make_tiny_model(root / MODEL)
    (root / "logs").mkdir()
    nats_server, auth = start_secured_nats(
        free_port(), root / "state", root / "logs" / "nats.log", (WORKER,), (TENANT,)
    )
    accounts_conf = auth.config.read_text()
    one_account_conf = json.dumps(one_account(json.loads(accounts_conf)), indent=2) + "\n"
    redis = start_redis(free_port(), root / "redis")
    env = {
        "LF_NATS_URL": nats_server.url,
        "LF_REDIS_URL": redis.url,
        "LF_MODEL_DIR": str(model_dir),
        "LF_DB_PATH": str(root / "audit.db"),
        "LF_ENGINE__MAX_NUM_SEQS": "4",
        "LF_ENGINE__KV_CACHE_BYTES": str(8 * 2**20),
        "LF_METRICS_PORT": "-1",
    }
    stack = Stack(env, root / "logs")
    admin = auth.admin_url(nats_server.url)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        for name in ("registry", "auditor", "scheduler"):
            stack.start(name, extra_env=auth.service_env(name))
        stack.start("worker", extra_env=auth.worker_env(WORKER))
        asyncio.run(wait_ready(admin, stack, ("registry", "auditor", "scheduler"), 180))
        asyncio.run(_ready_worker(admin, 180))
        for i in range(rounds * len(MODES)):
            mode = MODES[i % len(MODES)]
            write_private(auth.config, accounts_conf if mode == "accounts" else one_account_conf)
            if i:
                nats_server.stop()
                nats_server.start()
            asyncio.run(_settle(nats_server.url, auth))

            async def measure() -> list[float]:
                return [await _ttft(nats_server.url, auth, max_tokens) for _ in range(requests)]

            samples[mode] += asyncio.run(measure())
            print(f"round {i + 1}: {mode} median {statistics.median(samples[mode][-requests:]):.2f} ms", flush=True)
    finally:
        stack.stop_all(timeout_s=5)
        redis.stop()
        nats_server.stop()
    return summarize(samples, requests, rounds, max_tokens)


def summarize(samples: dict[str, list[float]], requests: int, rounds: int, max_tokens: int) -> dict:
    def figures(ms: list[float]) -> dict:
        ordered = sorted(ms)
        return {
            "n": len(ms),
            "median_ms": statistics.median(ms),
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
            "mean_ms": statistics.fmean(ms),
        }

    by_mode = {mode: figures(ms) for mode, ms in samples.items()}
    return {
        "requests_per_round": requests,
        "rounds_per_mode": rounds,
        "max_tokens": max_tokens,
        "modes": by_mode,
        "median_ratio_accounts_over_one_account": by_mode["accounts"]["median_ms"]
        / by_mode["one-account"]["median_ms"],
    }


def markdown(result: dict) -> str:
    lines = [
        "| NATS model | requests | TTFT median (ms) | p90 (ms) | mean (ms) |",
        "|---|---|---|---|---|",
    ]
    for mode, f in result["modes"].items():
        lines.append(f"| {mode} | {f['n']} | {f['median_ms']:.2f} | {f['p90_ms']:.2f} | {f['mean_ms']:.2f} |")
    lines.append(f"\nmedian ratio accounts / one account: {result['median_ratio_accounts_over_one_account']:.3f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per NATS model (alternating)")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args()
    result = run(args.requests, args.rounds, args.max_tokens)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "direct_nats.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "direct_nats.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
