"""Registry at fleet scale: 10,000 adapter records, resolve latency through NATS, registry RSS.

``python -m bench.registry_scale [--quick]``: writes N records straight into the KV bucket
(records only: admission is measured by the tests, not here), starts ``python -m
services.registry`` as its own process (it loads every record at start), then times
resolve round trips, sequential and 32 in flight, beside the in-process resolve call (the
floor: what the service adds is NATS and JSON). RSS is read from /proc before and after load.
"""

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from lorafleet.cli.infra import free_port, start_nats
from services.registry.kv import RecordsKV
from shared import subjects
from shared.base_model import EMBEDDED_MODEL_NAME
from shared.bus import connect, decode, request
from shared.catalog.records import Catalog
from shared.catalog.resolve import resolve
from shared.schemas import AdapterRecord, ResolveReply, ResolveRequest, ServiceHeartbeat

RESULTS = Path(__file__).parent / "results" / "registry_scale.json"
TENANTS = 100
DIGEST = "0" * 64


def make_record(i: int) -> AdapterRecord:
    adapter_id, tenant = f"adapter-{i:05d}", f"tenant-{i % TENANTS:03d}"
    return AdapterRecord(
        adapter_id=adapter_id, version=1, tenant_id=tenant, base_model=EMBEDDED_MODEL_NAME,
        base_model_fingerprint=DIGEST, task_type="chat", rank=(8, 16, 32, 64)[i % 4], alpha=16.0,
        target_modules=["q_proj", "v_proj"], files={"adapter_model.safetensors": DIGEST}, digest=DIGEST,
        manifest_digest=DIGEST, storage_uri=f"nats-os://{subjects.ADAPTER_STORE_BUCKET}/{adapter_id}/1",
        status="production", traffic_percent=100.0, aliases=[f"alias-{i:05d}"],
    )  # fmt: skip


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def percentiles(samples_ms: list[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    return {
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "mean_ms": statistics.fmean(ordered),
    }


def queries(n: int, records: int, seed: int = 0) -> list[ResolveRequest]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        i = rng.randrange(records)
        model = f"adapter-{i:05d}" if k % 2 else f"alias-{i:05d}"
        out.append(ResolveRequest(tenant_id=f"tenant-{i % TENANTS:03d}", model=model, request_key=f"r{k}"))
    return out


async def wait_ready(nc, timeout_s: float) -> float:
    sub = await nc.subscribe(subjects.service_heartbeat("registry"))
    start = time.perf_counter()
    while True:
        beat = decode(ServiceHeartbeat, (await sub.next_msg(timeout=timeout_s)).data)
        if beat.ready:
            await sub.unsubscribe()
            return time.perf_counter() - start


async def measure(nats_url: str, n_records: int, n_resolves: int) -> dict:
    nc = await connect(nats_url, "bench")
    kv = await RecordsKV.open(nc.jetstream())
    records = [make_record(i) for i in range(n_records)]
    start = time.perf_counter()
    for chunk in range(0, n_records, 500):
        await asyncio.gather(*(kv.put_record(r) for r in records[chunk : chunk + 500]))
    write_s = time.perf_counter() - start
    gc.freeze()  # the bench's own copy of the records must not add GC pauses to the timings

    env = {**os.environ, "LF_NATS_URL": nats_url, "LF_INSTANCE_ID": "bench-registry", "LF_LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "services.registry", env=env)
    try:
        start_s = await wait_ready(nc, 300)
        rss_loaded = rss_mb(proc.pid)
        qs = queries(n_resolves, n_records)
        for q in qs[:200]:  # warm-up
            await request(nc, subjects.registry("resolve"), q, ResolveReply, 5)
        sequential = []
        for q in qs:
            t = time.perf_counter()
            await request(nc, subjects.registry("resolve"), q, ResolveReply, 5)
            sequential.append((time.perf_counter() - t) * 1000)
        concurrent: list[float] = []
        sem = asyncio.Semaphore(32)

        async def one(q: ResolveRequest) -> None:
            async with sem:
                t = time.perf_counter()
                await request(nc, subjects.registry("resolve"), q, ResolveReply, 5)
                concurrent.append((time.perf_counter() - t) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(q) for q in qs))
        throughput = len(qs) / (time.perf_counter() - t0)
        rss_after = rss_mb(proc.pid)
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
        await nc.drain()
        gc.unfreeze()

    del records
    tracemalloc.start()
    catalog = Catalog(make_record(i) for i in range(n_records))
    catalog_mb = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    local = []
    for q in qs:
        t = time.perf_counter()
        resolve(catalog, EMBEDDED_MODEL_NAME, q.tenant_id, q.model, q.request_key)
        local.append((time.perf_counter() - t) * 1000)
    return {
        "records": n_records, "resolves": n_resolves, "kv_write_s": write_s, "start_to_ready_s": start_s,
        "rss_mb_loaded": rss_loaded, "rss_mb_after": rss_after, "resolve_per_s_32_in_flight": throughput,
        "nats_sequential": percentiles(sequential), "nats_32_in_flight": percentiles(concurrent),
        "in_process": percentiles(local), "catalog_mb": catalog_mb, "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }  # fmt: skip


def table(r: dict) -> str:
    rows = [
        ("resolve via NATS, sequential", r["nats_sequential"]),
        ("resolve via NATS, 32 in flight", r["nats_32_in_flight"]),
        ("resolve in-process (floor)", r["in_process"]),
    ]
    floor = r["in_process"]["p50_ms"]
    lines = [f"Registry with {r['records']:,} adapter records, {r['resolves']:,} resolves "
             f"({r['cpus']} CPUs, load average {r['load_average_1m']:.1f} during the run)", "",
             "| path | p50 ms | p99 ms | p50 / in-process |", "|---|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {name} | {p['p50_ms']:.3f} | {p['p99_ms']:.3f} | {p['p50_ms'] / floor:.0f}x |" for name, p in rows]
    lines += ["", f"registry RSS: {r['rss_mb_loaded']:.0f} MiB loaded, {r['rss_mb_after']:.0f} MiB after the run "
              f"(the catalog itself: {r['catalog_mb']:.1f} MiB, the rest is the Python/torch runtime); "
              f"start to ready {r['start_to_ready_s']:.1f} s; KV write of all records {r['kv_write_s']:.1f} s; "
              f"{r['resolve_per_s_32_in_flight']:.0f} resolves/s with 32 in flight; "
              f"p99 target <= 5 ms: {'met' if r['nats_sequential']['p99_ms'] <= 5 else 'MISSED'}"]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 resolves instead of 20,000")
    parser.add_argument("--records", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as state:
        server = start_nats(free_port(), Path(state))
        try:
            result = asyncio.run(measure(server.url, args.records, 2_000 if args.quick else 20_000))
        finally:
            server.stop()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
