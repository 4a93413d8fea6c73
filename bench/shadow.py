"""Shadow evaluation's cost to served traffic: production requests' TPOT with the canary answering a
sample of them in the shadow, vs none, on the built-in engine.

``python -m bench.shadow [--quick] [--rounds N] [--threads N] [--device cpu|cuda]``: SmolLM2 fp32, two
random rank-16 adapters (production and canary) on one engine, a closed loop of ``concurrency``
production requests (greedy, EOS ignored, ``new_tokens`` each) until ``requests`` of them ended.
Each sample share's peer (0 = off, 5 % = ``LF_SHADOW_SAMPLE``'s default, 100 %) adds, with every
sampled production request, the canary's shadow run of the same prompt in the batch SLO class, as
the scheduler queues it when a worker accepts the production request. The peers run in the same
rounds, the first to run rotating; each figure is the median round, and each ratio the median of the
per-round ratios to the off peer. Writes JSON and a Markdown table under ``bench/results``.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.engine import chat_prompts
from bench.environment import device_argument, environment, rounds_argument, threads_argument
from bench.multilora import QV, RANK, engine_with, save_adapters
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS, spread, spread_text
from services.worker.engine import EngineRequest, LLMEngine
from services.worker.engine.model_loader import load_model
from services.worker.lora import MODULES, LoraConfig, ModelShapes
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results"
SHARES = (0.0, 0.05, 1.0)


def sampled(k: int, share: float) -> bool:
    """Every 1/share-th request: the share exactly, spread evenly over the run."""
    return share > 0 and int((k + 1) * share) > int(k * share)


def served_round(
    engine: LLMEngine, prompts: list[list[int]], share: float, concurrency: int, requests: int, new_tokens: int
) -> dict[str, float]:
    """Production TPOT (ms, p50 and mean) and throughput over one closed-loop run at ``share``."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    started = {"n": 0, "shadows": 0}
    first: dict[str, float] = {}
    tpots: list[float] = []

    def add() -> None:
        k = started["n"]
        started["n"] += 1
        prompt = prompts[k % len(prompts)]
        engine.add_request(EngineRequest(f"p{k}", prompt, params, adapter="prod"))
        if sampled(k, share):
            started["shadows"] += 1
            engine.add_request(EngineRequest(f"s{k}", prompt, params, adapter="canary", slo_class="batch"))

    begin = time.perf_counter()
    for _ in range(concurrency):
        add()
    ended = 0
    while engine.has_unfinished():
        for out in engine.step():
            production = out.request_id.startswith("p")
            if production and out.first_token_time is not None:
                first.setdefault(out.request_id, out.first_token_time)
            if production and out.finished:
                tpots.append((time.monotonic() - first[out.request_id]) / max(1, new_tokens - 1) * 1000)
                ended += 1
                if started["n"] < requests:
                    add()
    wall = time.perf_counter() - begin
    return {
        "tpot_p50_ms": statistics.median(tpots),
        "tpot_mean_ms": statistics.fmean(tpots),
        "production_tok_s": ended * new_tokens / wall,
        "shadow_runs": started["shadows"],
    }


def table(result: dict) -> str:
    lines = [
        "| shadow sample | production TPOT p50 ms (min-max) | TPOT p50 vs off | TPOT mean vs off | production tok/s vs off | shadow runs |",
        "|---|---|---|---|---|---|",
    ]
    for name, peer in result["peers"].items():
        lines.append(
            f"| {name} | {spread_text(peer['tpot_p50_ms'])} | {peer['tpot_p50_ratio']['median']:.3f} | "
            f"{peer['tpot_mean_ratio']['median']:.3f} | {peer['tok_s_ratio']['median']:.3f} | {peer['shadow_runs']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a minute or two on a CPU")
    rounds_argument(parser)
    threads_argument(parser)
    device_argument(parser)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--concurrency", type=int, help="production requests in flight (default 16, quick 4)")
    parser.add_argument("--requests", type=int, help="production requests per round (default 200, quick 40)")
    parser.add_argument("--new-tokens", type=int, help="tokens each request generates (default 32, quick 16)")
    parser.add_argument(
        "--shares", type=lambda v: tuple(float(x) for x in v.split(",")), default=SHARES,
        help="sample shares to run, the first 0 (the peer the others are compared with); default 0,0.05,1",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    concurrency, requests, new_tokens = (4, 40, 16) if args.quick else (16, 200, 32)
    concurrency = args.concurrency or concurrency
    requests = args.requests or requests
    new_tokens = args.new_tokens or new_tokens
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    loaded = load_model(device=args.device)
    prompts = chat_prompts(loaded, 16)
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    budget = 4 * RANK * shapes.params_per_rank(MODULES) * 4  # a slot is sized for every projection
    engine, manager = engine_with(
        loaded, LoraConfig(rank_classes=(RANK,), memory_budget_bytes=budget, max_num_tokens=2048), 2 * concurrency,
        args.device,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        for name, directory in zip(
            ("prod", "canary"), save_adapters(loaded.model, ["prod", "canary"], QV, Path(root)), strict=True
        ):
            manager.load_adapter(name, directory)
    served_round(engine, prompts, 1.0, 2, 2, 2)  # warm both adapters' paths
    assert args.shares[0] == 0, "the first share is the off peer"
    names = [f"{share:.0%}" if share else "off" for share in args.shares]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for turn in range(rounds):
        order = list(zip(names, args.shares, strict=True))
        for name, share in order[turn % len(order) :] + order[: turn % len(order)]:
            runs[name].append(served_round(engine, prompts, share, concurrency, requests, new_tokens))
            print(name, runs[name][-1], flush=True)
    off = runs["off"]
    peers = {
        name: {
            "tpot_p50_ms": spread([r["tpot_p50_ms"] for r in rs]),
            "tpot_p50_ratio": spread([r["tpot_p50_ms"] / o["tpot_p50_ms"] for r, o in zip(rs, off, strict=True)]),
            "tpot_mean_ratio": spread([r["tpot_mean_ms"] / o["tpot_mean_ms"] for r, o in zip(rs, off, strict=True)]),
            "tok_s_ratio": spread(
                [r["production_tok_s"] / o["production_tok_s"] for r, o in zip(rs, off, strict=True)]
            ),
            "shadow_runs": int(rs[0]["shadow_runs"]),
        }
        for name, rs in runs.items()
    }
    result = {
        "environment": environment(args.threads, "float32", args.device),
        "quick": args.quick,
        "rounds": rounds,
        "concurrency": concurrency,
        "requests": requests,
        "new_tokens": new_tokens,
        "peers": peers,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "shadow_quick" if args.quick else "shadow"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{stem}.md").write_text(table(result) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
