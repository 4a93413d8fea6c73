"""The release controller's added load on the registry: 100 concurrent rollouts under steady traffic.

``python -m bench.release_controller [--quick]``: three peers, each a fresh nats-server and a
``python -m services.registry`` process holding 100 adapters (v1 in production, v2 staging with a
passing eval), fed the same steady completion traffic on the AUDIT stream, measured in the same
run and interleaved round by round:

- ``main``: the registry of the ``main`` branch (no controller: it never reads AUDIT);
- ``idle``: this registry, no rollout (it follows AUDIT and drops every record on arrival);
- ``rollouts``: this registry driving 100 rollouts (each at 1%, judged every tick on its live figures).

Per peer: the registry's CPU (utime + stime from /proc, percent of one core) over the window, and
the latency of sequential ``resolve`` requests made meanwhile. Writes JSON and a Markdown table.
"""

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lorafleet.cli.infra import free_port, start_nats
from services.registry.kv import RecordsKV
from shared import subjects
from shared.base_model import EMBEDDED_MODEL_NAME
from shared.bus import connect, decode, encode, ensure_streams, request
from shared.catalog.rollout import in_canary
from shared.schemas import (
    AdapterRecord,
    AuditEnvelope,
    CompletionAudit,
    ReleaseStartRequest,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    ResolveReply,
    ResolveRequest,
    ServiceHeartbeat,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
ADAPTERS = 100
DIGEST = "0" * 64
PEERS = ("main", "idle", "rollouts")
TICK_HZ = os.sysconf("SC_CLK_TCK")


def record(i: int, version: int) -> AdapterRecord:
    adapter_id = f"adapter-{i:03d}"
    released = {"status": "production", "traffic_percent": 100.0, "promoted_at": 1.0} if version == 1 else {}
    return AdapterRecord(
        adapter_id=adapter_id, version=version, tenant_id=f"tenant-{i % 10}", base_model=EMBEDDED_MODEL_NAME,
        base_model_fingerprint=DIGEST, task_type="chat", rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"],
        files={"adapter_model.safetensors": DIGEST}, digest=DIGEST, manifest_digest=DIGEST,
        storage_uri=f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/{adapter_id}/{version}",
        eval_results={"score": 0.9, "threshold": 0.5}, **released,
    )  # fmt: skip


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_HZ  # utime, stime


def main_tree(into: Path) -> Path:
    """The ``main`` branch's code, as the registry runs it (no release controller)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "main", "services", "shared", "kernels"],
                             check=True, capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def wait_ready(nc, timeout_s: float) -> None:
    sub = await nc.subscribe(subjects.service_heartbeat("registry"))
    while not decode(ServiceHeartbeat, (await sub.next_msg(timeout=timeout_s)).data).ready:
        pass
    await sub.unsubscribe()


async def traffic(nc, rate: float, stop: asyncio.Event) -> int:
    """Completion records at ``rate`` per second over every adapter, 1% of each on v2."""
    js, sent, counter = nc.jetstream(), 0, itertools.count()
    batch, start = max(1, int(rate / 20)), time.perf_counter()
    while not stop.is_set():
        acks = []
        for _ in range(batch):
            k = next(counter)
            adapter_id = f"adapter-{k % ADAPTERS:03d}"
            version = 2 if in_canary(adapter_id, f"user-{k}", 1.0) else 1
            body = CompletionAudit(
                request_id=f"req-{k}", tenant_id=f"tenant-{k % ADAPTERS % 10}", base_model=EMBEDDED_MODEL_NAME,
                adapter_id=adapter_id, adapter_version=version, cache_hit=True, ttft_ms=40.0 + k % 30,
                tpot_ms=9.0 + k % 4, prompt_tokens=20, completion_tokens=12, worker_id="w1", outcome="stop",
            )  # fmt: skip
            acks.append(js.publish(subjects.audit("completion", body.tenant_id), encode(AuditEnvelope(body=body))))
        await asyncio.gather(*acks)
        sent += batch
        await asyncio.sleep(max(0.0, start + sent / rate - time.perf_counter()))
    return sent


async def resolves(nc, stop: asyncio.Event) -> list[float]:
    latencies, k = [], 0
    while not stop.is_set():
        i = k % ADAPTERS
        q = ResolveRequest(tenant_id=f"tenant-{i % 10}", model=f"adapter-{i:03d}", request_key=f"r{k}")
        t = time.perf_counter()
        await request(nc, subjects.registry("resolve"), q, ResolveReply, 5)
        latencies.append((time.perf_counter() - t) * 1000)
        k += 1
        await asyncio.sleep(0.01)
    return latencies


async def measure(peer: str, code_dir: Path, rate: float, window_s: float, warm_s: float) -> dict:
    with tempfile.TemporaryDirectory() as state:
        server = start_nats(free_port(), Path(state))
        nc = await connect(server.url, "bench")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            kv = await RecordsKV.open(js)
            await asyncio.gather(*(kv.put_record(record(i, v)) for i in range(ADAPTERS) for v in (1, 2)))
            env = {**os.environ, "LF_NATS_URL": server.url, "LF_INSTANCE_ID": "bench", "LF_LOG_LEVEL": "WARNING",
                   "LF_METRICS_PORT": "-1", "PYTHONPATH": str(code_dir)}  # fmt: skip
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.registry", env=env, cwd=code_dir
            )
            try:
                await wait_ready(nc, 300)
                if peer == "rollouts":
                    for i in range(ADAPTERS):
                        start = ReleaseStartRequest(adapter_id=f"adapter-{i:03d}", version=2, actor="bench")
                        await request(nc, subjects.registry("release_start"), start, ReleaseStatusReply, 30)
                stop = asyncio.Event()
                sending = asyncio.create_task(traffic(nc, rate, stop))
                await asyncio.sleep(warm_s)
                asking = asyncio.create_task(resolves(nc, stop))
                cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
                await asyncio.sleep(window_s)
                cpu1, t1 = cpu_s(proc.pid), time.perf_counter()
                stop.set()
                sent, latencies = await sending, await asking
                running = None
                if peer == "rollouts":  # every rollout still judged and held (no sample count reached)
                    status = await request(
                        nc, subjects.registry("release_status"), ReleaseStatusRequest(), ReleaseStatusReply, 30
                    )
                    running = sum(r.phase == "running" for r in status.releases)
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 10)
        finally:
            await nc.close()
            server.stop()
    ordered = sorted(latencies)
    return {
        "peer": peer, "cpu_percent": 100 * (cpu1 - cpu0) / (t1 - t0), "completions_sent": sent,
        "resolves": len(ordered), "resolve_p50_ms": statistics.median(ordered),
        "resolve_p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], "running_rollouts": running,
    }  # fmt: skip


def table(runs: list[dict], rate: float, window_s: float) -> str:
    by_peer = {p: [r for r in runs if r["peer"] == p] for p in PEERS}
    mean = {p: {k: statistics.fmean(r[k] for r in rs) for k in ("cpu_percent", "resolve_p50_ms", "resolve_p99_ms")}
            for p, rs in by_peer.items()}  # fmt: skip
    base = mean["main"]
    lines = [
        f"Registry with {ADAPTERS} adapters under {rate:.0f} completion records/s, {window_s:.0f} s windows, "
        f"{len(by_peer['main'])} interleaved rounds ({os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}; the machine was shared and contended: read the ratios)",
        "",
        "| peer | registry CPU % of a core | x main | resolve p50 ms | x main | resolve p99 ms | x main |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in PEERS:
        m = mean[p]
        lines.append(
            f"| {p} | {m['cpu_percent']:.1f} | {m['cpu_percent'] / base['cpu_percent']:.2f} | "
            f"{m['resolve_p50_ms']:.2f} | {m['resolve_p50_ms'] / base['resolve_p50_ms']:.2f} | "
            f"{m['resolve_p99_ms']:.2f} | {m['resolve_p99_ms'] / base['resolve_p99_ms']:.2f} |"
        )
    held = [r["running_rollouts"] for r in by_peer["rollouts"]]
    lines += ["", f"rollouts still running at the end of each window: {held}"]
    return "\n".join(lines)


async def run(rounds: int, rate: float, window_s: float, warm_s: float) -> list[dict]:
    runs = []
    with tempfile.TemporaryDirectory() as tree:
        dirs = {"main": main_tree(Path(tree)), "idle": REPO, "rollouts": REPO}
        for _ in range(rounds):
            for peer in PEERS:
                runs.append(await measure(peer, dirs[peer], rate, window_s, warm_s))
                print(json.dumps(runs[-1]))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 8 s windows instead of 3 of 20 s")
    parser.add_argument("--rate", type=float, default=500.0, help="completion records per second")
    args = parser.parse_args()
    rounds, window_s, warm_s = (1, 8.0, 3.0) if args.quick else (3, 20.0, 5.0)
    runs = asyncio.run(run(rounds, args.rate, window_s, warm_s))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "release_controller.json").write_text(json.dumps({"rate": args.rate, "runs": runs}, indent=2))
    text = table(runs, args.rate, window_s)
    (RESULTS / "release_controller.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
