"""Remote fetch of a 64 MB adapter from a local S3 server: time and peak memory, streamed vs buffered.

``python -m bench.remote_fetch [--rounds N]`` starts moto's S3 server (``moto_server``, its own
process, so its copy of the object is not counted) and a nats-server, uploads a valid 64 MB LoRA
adapter (rank 960 on a 4-layer, 256-wide Llama spec, all seven projections, fp32), then runs
each peer in a fresh process, the peers interleaved round by round:

- ``fetch``: the registry's RemoteFetcher (listing, both files streamed to disk, hashed on the way).
- ``boto3_download``: boto3's ``download_file`` of the weights to disk (streamed, no hashing, no SSRF check).
- ``boto3_read``: ``get_object()["Body"].read()``, the whole object in memory (the buffered peer).
- ``register``: a whole register through the registry service in the same process: allow-list
  check, fetch, the upload's admission (format, NaN, shapes over a read-only map), store.

Per run: wall time, and growth over the process's ready state of peak RSS (``VmHWM`` after a
``clear_refs`` reset) and of peak anonymous RSS (``RssAnon`` sampled every 2 ms: heap, not the
page cache's file pages a map of the weights shows as RSS). Writes JSON + a Markdown table.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "remote_fetch.json"
PEERS = ("fetch", "boto3_download", "boto3_read", "register")
BUCKET, KEY = "models", "acme/big/"
LAYERS = 4
SPEC = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 128,
}

RANK = 960  # 4 layers x 7 modules x 960 x (in + out) x 4 bytes = 63.8 MiB
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _status(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def measure(work: Callable[[], Coroutine[Any, Any, object]]) -> dict[str, float]:
    """Run ``work`` once; its wall time and peak memory growth over the state just before it."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    rss0, anon0 = _status("VmRSS"), _status("RssAnon")
    peak_anon = anon0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_anon
        while not done.is_set():
            peak_anon = max(peak_anon, _status("RssAnon"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    asyncio.run(work())
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    return {
        "seconds": round(seconds, 3),
        "peak_rss_growth_mb": round(_status("VmHWM") - rss0, 1),
        "peak_anon_growth_mb": round(max(peak_anon, _status("RssAnon")) - anon0, 1),
    }


def write_base_model(directory: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from shared.fingerprint import BaseModelSpec

    spec = BaseModelSpec.from_config(SPEC)
    tensors = {"model.embed_tokens.weight": torch.zeros(spec.vocab, spec.hidden_size)}
    for i in range(spec.num_layers):
        for module, (in_f, out_f) in spec.projection_dims().items():
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            tensors[f"model.layers.{i}.{block}.{module}.weight"] = torch.zeros(out_f, in_f)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(SPEC))
    save_file(tensors, directory / "model.safetensors")


def write_adapter(directory: Path) -> int:
    import torch
    from safetensors.torch import save_file

    from shared.fingerprint import BaseModelSpec

    dims = BaseModelSpec.from_config(SPEC).projection_dims()
    torch.manual_seed(0)
    tensors = {}
    for i in range(LAYERS):
        for module in MODULES:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            in_f, out_f = dims[module]
            name = f"base_model.model.model.layers.{i}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, in_f) * 0.01
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, RANK) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(MODULES),
              "task_type": "CAUSAL_LM", "bias": "none"}  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return (directory / "adapter_model.safetensors").stat().st_size


def child(peer: str, args: dict) -> dict[str, float]:
    """One peer's run, in this fresh process."""
    os.environ.update(AWS)
    if peer == "boto3_read":
        import boto3

        client = boto3.client("s3", endpoint_url=args["endpoint"])

        async def read() -> None:
            body = client.get_object(Bucket=BUCKET, Key=KEY + "adapter_model.safetensors")["Body"].read()
            assert len(body) == args["size"]

        return measure(read)
    if peer == "boto3_download":
        import boto3

        client = boto3.client("s3", endpoint_url=args["endpoint"])
        target = Path(tempfile.mkdtemp(prefix="lf-bench-boto3-")) / "adapter_model.safetensors"

        async def download() -> None:
            client.download_file(BUCKET, KEY + "adapter_model.safetensors", str(target))
            assert target.stat().st_size == args["size"]

        try:
            return measure(download)
        finally:
            shutil.rmtree(target.parent)
    if peer == "fetch":
        from services.registry.fetch_bounds import FetchBounds
        from services.registry.remote_fetch import RemoteFetcher
        from services.registry.settings import RemoteSourceSettings
        from services.registry.source_uri import parse_source
        from shared.schemas import SourceEntry

        settings = RemoteSourceSettings(s3_enabled=True, s3_endpoint_url=args["endpoint"])
        entry = SourceEntry(prefix=f"s3://{BUCKET}/", tenants=["acme"], allow_private=True, added_by="bench")
        spool = Path(tempfile.mkdtemp(prefix="lf-bench-fetch-"))
        bounds = FetchBounds(settings)

        async def fetch() -> None:
            location = parse_source(f"s3://{BUCKET}/{KEY}")
            with bounds.lease("acme", settings.timeout_s) as lease:
                fetcher = RemoteFetcher(settings)
                files = await fetcher.fetch(location, entry, lambda _: entry, spool, lease, settings.timeout_s)
            assert files["adapter_model.safetensors"].size == args["size"]

        try:
            return measure(fetch)
        finally:
            shutil.rmtree(spool)
    return asyncio.run(_register(args))


async def _register(args: dict) -> dict[str, float]:
    from services.registry.service import run
    from services.registry.settings import RegistrySettings, RemoteSourceSettings
    from shared import subjects
    from shared.bus import connect, request
    from shared.schemas import AdapterRecordsReply, AddSourceRequest, RegisterRequest, SourcesReply

    settings = RegistrySettings(
        nats_url=args["nats_url"], model_dir=args["base_dir"], dev_mode=True, max_rank=1024, metrics_port=-1,
        instance_id=f"bench-{os.getpid()}", remote=RemoteSourceSettings(s3_enabled=True, s3_endpoint_url=args["endpoint"]),
    )  # fmt: skip
    nc = await connect(args["nats_url"], "bench-remote")
    beats = await nc.subscribe(subjects.service_heartbeat("registry"))
    stop = asyncio.Event()
    service = asyncio.create_task(run(settings, stop))
    await beats.next_msg(timeout=60)
    await beats.unsubscribe()
    add = AddSourceRequest(prefix=f"s3://{BUCKET}/", tenants=["acme"], allow_private=True, actor="bench")
    await request(nc, subjects.registry("source_add"), add, SourcesReply, 10)
    register = RegisterRequest(adapter_id=args["adapter_id"], tenant_id="acme", task_type="bench",
                               source_uri=f"s3://{BUCKET}/{KEY}", actor="bench")  # fmt: skip
    loop = asyncio.get_running_loop()
    # measure() runs its own event loop; the registry lives in this one, so the push waits on it
    future = asyncio.run_coroutine_threadsafe(
        request(nc, subjects.registry("register"), register, AdapterRecordsReply, 120), loop
    )

    async def wait() -> None:
        reply = await asyncio.wrap_future(future)
        assert reply.records[0].origin is not None

    result = await loop.run_in_executor(None, measure, wait)
    stop.set()
    await service
    await nc.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("PEER", "ARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], json.loads(args.child[1]))))
        return

    from lorafleet.cli.infra import free_port, start_nats, wait_port

    root = Path(tempfile.mkdtemp(prefix="lf-bench-remote-"))
    write_base_model(root / "base")
    size = write_adapter(root / "adapter")
    port = free_port()
    moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    nats = start_nats(free_port(), root / "nats")
    try:
        wait_port(port, 30, moto)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS)
        import boto3

        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket=BUCKET)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            s3.upload_file(str(root / "adapter" / name), BUCKET, KEY + name)
        runs: list[dict] = []
        for round_ in range(args.rounds):
            for peer in PEERS:
                child_args = {"endpoint": endpoint, "size": size, "nats_url": nats.url,
                              "base_dir": str(root / "base"), "adapter_id": f"big-{round_}"}  # fmt: skip
                out = subprocess.run([sys.executable, "-m", "bench.remote_fetch", "--child", peer, json.dumps(child_args)],
                                     capture_output=True, text=True, check=True, env={**os.environ, "LF_LOG_LEVEL": "WARNING"})  # fmt: skip
                runs.append({"peer": peer, "round": round_, **json.loads(out.stdout.strip().splitlines()[-1])})
                print(runs[-1], flush=True)
    finally:
        moto.terminate()
        nats.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for peer in PEERS:
        mine = [r for r in runs if r["peer"] == peer]
        rows.append({"peer": peer, **{k: statistics.median(r[k] for r in mine) for k in
                                      ("seconds", "peak_rss_growth_mb", "peak_anon_growth_mb")}})  # fmt: skip
    buffered = next(r for r in rows if r["peer"] == "boto3_read")
    for row in rows:
        row["anon_vs_buffered"] = round(row["peak_anon_growth_mb"] / max(buffered["peak_anon_growth_mb"], 0.1), 3)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(
        json.dumps({"adapter_bytes": size, "rounds": args.rounds, "results": rows, "runs": runs}, indent=2)
    )
    lines = [f"adapter_model.safetensors: {size / 2**20:.1f} MiB; medians of {args.rounds} interleaved rounds", "",
             "| peer | seconds | peak RSS growth (MB) | peak anon RSS growth (MB) | anon vs buffered |",
             "|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['peer']} | {r['seconds']} | {r['peak_rss_growth_mb']} | {r['peak_anon_growth_mb']} | "
              f"{r['anon_vs_buffered']} |" for r in rows]  # fmt: skip
    RESULTS.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
