"""Adapter cache on the real worker serving path: TTFT of hits and misses, and of hits during a storm of misses.

``python -m bench.cache_live [--quick]``: SmolLM2 fp32 in process — the worker's RequestServer, the
engine and the cache hierarchy, adapters read from disk by the loader threads (the store fetch is
not included). Phases run interleaved, twice: hits alone, hits during a storm of misses on distinct
cold adapters, and hits during an equal storm of *hits* (the same extra batch work with nothing to
load), which separates the cost of loading from the cost of a bigger batch on 2 CPU cores.
Target: hit TTFT p50 during the miss storm <= 1.2x without it.
"""

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from bench.environment import environment
from bench.rounds import percentiles
from services.worker.adapter_cache import CacheConfig, CacheHierarchy
from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from shared.schemas import InferRequest, ReplyFinal, ResolvedAdapter, SamplingParams

RESULTS = Path(__file__).parent / "results" / "cache_live.json"
DIGEST = "0" * 64


def make_adapters(loaded: LoadedModel, root: Path, count: int) -> list[Path]:
    """``count`` random rank-8 q,v adapters (one PEFT model, re-seeded weights per save)."""
    model = get_peft_model(
        loaded.model, PeftLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    dirs = []
    for i in range(count):
        torch.manual_seed(i)
        for name, p in model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, std=0.02)
        model.save_pretrained(str(root / f"a{i}"))
        dirs.append(root / f"a{i}")
    model.unload()
    return dirs


def request(loaded: LoadedModel, rid: str, adapter: int, tokens: int) -> InferRequest:
    resolved = ResolvedAdapter(
        adapter_id=f"a{adapter}", version=1, rank=8, digest=DIGEST, storage_uri="bench://", alpha=16
    )
    return InferRequest(
        request_id=rid,
        tenant_id="bench",
        model=f"a{adapter}",
        base_model=loaded.name,
        adapter=resolved,
        prompt="Write a short note about the weather today.",
        reply_to=f"_INBOX.{rid}",
        sampling=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
    )


async def drain(server: RequestServer) -> None:
    """Wait until every request the server accepted has finished (its task removes itself when done)."""
    while server.tasks:
        await asyncio.wait(list(server.tasks.values()))


async def run(quick: bool) -> dict:
    loaded = load_model()
    hits, storm, tokens, gap_s = (4, 6, 4, 0.4) if quick else (10, 16, 8, 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = make_adapters(loaded, Path(tmp), 1 + storm * 2)
        manager = AdapterManager(
            LoraConfig(
                rank_classes=(8,), memory_budget_bytes=2**26, max_slots_per_class=6, target_modules=("q_proj", "v_proj")
            ),
            ModelShapes.from_hf_config(loaded.model.config),
        )
        cache = CacheHierarchy(
            manager, lambda key: manager.read_adapter(dirs[int(key[1:].split("@")[0])]), CacheConfig(cpu_budget_bytes=1)
        )  # no CPU tier: every miss reads the store
        engine = AsyncEngine.from_loaded(
            loaded,
            EngineConfig(kv_cache_bytes=256 * 2**20, max_model_len=512, max_num_batched_tokens=512),
            adapter_manager=manager,
        )
        engine.start()
        finals: dict[str, ReplyFinal] = {}

        async def emit(reply_to: str, message) -> None:
            if isinstance(message, ReplyFinal):
                finals[message.request_id] = message

        async def audit(_) -> None:
            return None

        prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)  # as the worker tokenises
        server = RequestServer(engine, prompts, "bench", loaded.name, emit, audit, 1024, cache)
        await server.accept(request(loaded, "warm", 0, 2))
        await drain(server)
        ids: dict[str, list[str]] = {
            "hit_alone": [],
            "hit_storm": [],
            "miss_storm": [],
            "hit_hitstorm": [],
            "hitstorm": [],
        }

        async def hits_phase(label: str, n: int) -> None:
            for _ in range(n):
                rid = f"{label}-{len(ids[label])}"
                ids[label].append(rid)
                await server.accept(request(loaded, rid, 0, tokens))
                await asyncio.sleep(gap_s)

        for round_ in range(2):
            await hits_phase("hit_alone", hits)
            await drain(server)
            for j in range(storm):
                rid = f"miss-{round_}-{j}"
                ids["miss_storm"].append(rid)
                await server.accept(request(loaded, rid, 1 + round_ * storm + j, tokens))
            await hits_phase("hit_storm", hits)
            await drain(server)
            for j in range(storm):
                rid = f"hitstorm-{round_}-{j}"
                ids["hitstorm"].append(rid)
                await server.accept(request(loaded, rid, 0, tokens))
            await hits_phase("hit_hitstorm", hits)
            await drain(server)
        cache.close()
        engine.shutdown()
    ttft = {k: percentiles([finals[r].ttft_ms for r in v]) for k, v in ids.items()}
    stats = cache.stats()
    return {
        "environment": environment(torch.get_num_threads(), "float32"),
        "quick": quick,
        "ttft_ms": ttft,
        "storm_ratio_p50": ttft["hit_storm"]["p50"] / ttft["hit_alone"]["p50"],
        "storm_ratio_p95": ttft["hit_storm"]["p95"] / ttft["hit_alone"]["p95"],
        "miss_storm_vs_hit_storm_p50": ttft["hit_storm"]["p50"] / ttft["hit_hitstorm"]["p50"],
        "hit_cache_flags": sorted({finals[r].served_by.cache_hit for r in ids["hit_storm"]}),
        "miss_cache_flags": sorted({finals[r].served_by.cache_hit for r in ids["miss_storm"]}),
        "loads": stats.loads,
        "load_ms_mean": stats.load_ms_mean,
        "evictions": stats.evictions,
        "requests": {k: len(v) for k, v in ids.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, finishes in about a minute")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = asyncio.run(run(args.quick))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    t = result["ttft_ms"]
    print("| requests | TTFT p50 ms | TTFT p95 ms |\n|---|---:|---:|")
    for name, label in (
        ("hit_alone", "hits alone"),
        ("hit_storm", "hits during a miss storm"),
        ("hit_hitstorm", "hits during an equal storm of hits"),
        ("miss_storm", "misses (storm)"),
    ):
        print(f"| {label} | {t[name]['p50']:.0f} | {t[name]['p95']:.0f} |")
    print(
        f"\nhit TTFT during storm / without: p50 {result['storm_ratio_p50']:.2f}x, p95 {result['storm_ratio_p95']:.2f}x"
        f" (target p50 <= 1.2x); vs an equal storm of hits: p50 {result['miss_storm_vs_hit_storm_p50']:.2f}x; loads {result['loads']}, mean load {result['load_ms_mean']}"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
