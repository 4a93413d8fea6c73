"""The floor of the platform's request path on this machine: the same processes, buses and hops as
the real stack, with no application work at all.

``python -m bench.hop_floor [--quick]`` starts nats-server and redis-server and three bare Python
processes on the services' libraries and event loop (nats-py, redis-py, uvloop): a *gateway* that
takes a line over TCP and publishes it to a JetStream work queue, a *scheduler* that pulls it,
runs one Redis Lua script (admission) and asks the *worker* over NATS request-reply, and a worker
that accepts, computes for about a prefill's time (torch matmuls on every core, as the engine
does) and publishes a "first token" back to the gateway's inbox, which the gateway writes to the
client. Overhead = the client's time to its first token minus the worker's own time (from taking the
request to its first token back on its event loop), as ``bench.gateway_overhead`` pairs it. What this takes is what the hops alone cost here: wake-ups of
idle processes and cold caches after the compute, before any parsing, validation or routing.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shared import event_loop

RESULTS = Path(__file__).parent / "results" / "hop_floor.json"
STREAM, SUBJECT, DISPATCH = "FLOOR", "floor.submit", "floor.dispatch"
ADMIT = "redis.call('INCR', KEYS[1]) return 1"


async def gateway(nats_url: str, port: int) -> None:
    import nats

    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            inbox = nc.new_inbox()
            done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

            async def on_token(msg, done: asyncio.Future[bytes] = done) -> None:
                if not done.done():
                    done.set_result(msg.data)

            sub = await nc.subscribe(inbox, cb=on_token)
            await js.publish(SUBJECT, json.dumps({"reply_to": inbox, "body": line.decode()}).encode())
            writer.write(await done + b"\n")  # the worker's own time to its first token, in ms
            await sub.unsubscribe()

    server = await asyncio.start_server(client, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def scheduler(nats_url: str, redis_url: str) -> None:
    import nats
    from redis.asyncio import Redis

    nc = await nats.connect(nats_url)
    psub = await nc.jetstream().pull_subscribe(SUBJECT, durable="floor", stream=STREAM)
    redis = Redis.from_url(redis_url)
    admit = redis.register_script(ADMIT)
    while True:
        try:
            msgs = await psub.fetch(batch=1, timeout=0.5)
        except Exception:
            continue
        for msg in msgs:
            await admit(keys=["floor:admitted"], args=[])
            while True:  # a worker still starting (importing torch) has no subscription yet
                try:
                    await nc.request(DISPATCH, msg.data, timeout=5)
                    break
                except nats.errors.NoRespondersError:
                    await asyncio.sleep(0.1)
            await msg.ack()


async def worker(nats_url: str, compute_ms: float) -> None:
    import nats
    import torch

    nc = await nats.connect(nats_url)
    a = torch.randn(1024, 1024)

    def prefill() -> None:
        started = time.perf_counter()
        while (time.perf_counter() - started) * 1000 < compute_ms:
            a @ a

    async def on_dispatch(msg) -> None:
        # timed as the real worker times its TTFT: from taking the request to its first token back
        # on the event loop (the compute thread's hand-offs included)
        started = time.perf_counter()
        request = json.loads(msg.data)
        await msg.respond(b"accepted")
        await asyncio.to_thread(prefill)
        spent = (time.perf_counter() - started) * 1000
        await nc.publish(request["reply_to"], f"{spent:.3f}".encode())

    await nc.subscribe(DISPATCH, cb=on_dispatch)
    await asyncio.Event().wait()


async def _client(port: int, requests: int, warmup: int, settle_s: float) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    overheads = []
    for i in range(warmup + requests):
        await asyncio.sleep(settle_s)
        started = time.perf_counter()
        writer.write(b"In one sentence, what is the sea?\n")
        worker_ms = float(await reader.readline())
        if i >= warmup:
            overheads.append((time.perf_counter() - started) * 1000 - worker_ms)
    writer.close()
    return overheads


async def _setup(nats_url: str) -> None:
    import nats

    nc = await nats.connect(nats_url)
    await nc.jetstream().add_stream(name=STREAM, subjects=[SUBJECT], retention="workqueue")
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="30 requests instead of 200")
    parser.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("gateway", "scheduler", "worker"), help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--compute-ms", type=float, default=170.0, help="the worker's stand-in prefill")
    parser.add_argument("--settle-ms", type=float, default=50.0, help="idle time before each request")
    args = parser.parse_args()
    if args.role == "gateway":
        return event_loop.run(gateway(args.nats, args.port))
    if args.role == "scheduler":
        return event_loop.run(scheduler(args.nats, args.redis))
    if args.role == "worker":
        return event_loop.run(worker(args.nats, args.compute_ms))

    from bench.cache_sim import git_commit
    from lorafleet.cli.infra import free_port, start_nats, start_redis, wait_port

    root = Path(tempfile.mkdtemp(prefix="lf-floor-"))
    nats, redis = start_nats(free_port(), root / "nats"), start_redis(free_port(), root / "redis")
    port = free_port()
    me = [sys.executable, "-m", "bench.hop_floor", "--nats", nats.url]
    procs = []
    try:
        asyncio.run(_setup(nats.url))
        procs = [
            subprocess.Popen([*me, "--role", "gateway", "--port", str(port)]),
            subprocess.Popen([*me, "--role", "scheduler", "--redis", redis.url]),
            subprocess.Popen([*me, "--role", "worker", "--compute-ms", str(args.compute_ms)]),
        ]
        wait_port(port, 30, procs[0])
        time.sleep(3)  # let the scheduler's consumer and the worker's subscription settle before timing
        requests, warmup = (30, 5) if args.quick else (200, 10)
        requests = args.requests or requests
        overheads = asyncio.run(_client(port, requests, warmup, args.settle_ms / 1000))
    finally:
        for proc in procs:
            proc.terminate()
        redis.stop()
        nats.stop()
    ordered = sorted(overheads)
    result = {
        "p50": statistics.median(ordered),
        "p95": ordered[round(0.95 * (len(ordered) - 1))],
        "n": len(ordered),
        "compute_ms": args.compute_ms,
        "settle_ms": args.settle_ms,
        "cpus": os.cpu_count(),
        "git_commit": git_commit(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**result, "raw_ms": overheads}, indent=2))
    print(
        "| floor of the request path (no application work) | p50 (ms) | p95 (ms) | n |\n|---|---:|---:|---:|\n"
        f"| client first token - worker's own time to it | {result['p50']:.2f} | {result['p95']:.2f} | {result['n']} |"
    )


if __name__ == "__main__":
    main()
