"""Multi-LoRA throughput: the engine with 32 distinct adapters vs itself without, HF PEFT and plain HF.

``python -m bench.multilora [--quick] [--rounds N] [--threads N] [--device cpu|cuda]``: the machine's
roofline first (bench/roofline.py). Then SmolLM2 fp32, one batch of chat prompts (20-60 tokens), each
request with its own random rank-16 adapter, EOS ignored so every system generates the same tokens;
5 rounds (3 with --quick), every system once per round, the first to run rotating; each figure is
the median round (min and max beside it), each TPOT also a multiple of its decode step floor. The
same figures for adapters on all seven projections follow, then rank skew: decode step time of 31
rank-8 + 1 rank-64 requests, and of every adapter zero-padded to rank 64, vs 32 rank-8 requests.
"""

import argparse
import copy
import json
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TypedDict

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft import __version__ as peft_version
from transformers import GenerationMixin, PreTrainedModel

from bench.engine import StepClock, chat_prompts, run_engine
from bench.environment import device_argument, environment, rounds_argument, threads_argument
from bench.roofline import LimitsProbe, ProbeSpread, roofline, roofline_line, step_floor_ms, weights_of
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS, Run, Spread, Summary, spread, spread_text, summarise
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import MODULES, AdapterManager, AdapterWeights, LoraConfig, ModelShapes
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "multilora.json"
QV = ("q_proj", "v_proj")
SMALL_BATCHES = (1, 8)  # where a LoRA step's fixed costs show (at most the headline batch)
RANK = 16


class RankSkew(TypedDict):
    ratio: float
    padded_ratio: float
    step_ms: dict[str, float]  # median decode step of each case
    step_spread_ms: dict[str, Spread]
    step_vs_floor: dict[str, float]


class SmallBatch(TypedDict):
    batch: int
    tok_s: dict[str, float]  # base, multilora (q,v), multilora_all: median round
    tpot_p50_ms: dict[str, float]
    ratio_vs_base: float  # multilora tok/s / base tok/s, q,v
    tpot_ratio_vs_base: float  # base TPOT / multilora TPOT (1.0 = no decode cost), q,v
    all_modules_ratio_vs_base: float


class Result(TypedDict):
    environment: dict[str, object]
    quick: bool
    rounds: int
    headline: str
    roofline: dict[str, float]
    roofline_probes: ProbeSpread
    batch_size: int
    new_tokens: int
    prompt_tokens: list[int]
    adapters: int
    rank_mix: dict[str, int]
    target_modules: list[str]
    systems: dict[str, Summary]
    tok_s: dict[str, float]
    ttft_ms: dict[str, dict[str, float]]
    tpot_ms: dict[str, dict[str, float]]
    step_floor_ms: float
    tpot_vs_floor: dict[str, float]  # each system's median TPOT p50 / step_floor_ms
    # Distinct adapters' A and B read per decode step (every token its own adapter), fp32, and that read at
    # the machine's bandwidth: what multi-LoRA adds to a step at the least ("qv", "all")
    lora_read_mb: dict[str, float]
    lora_floor_ms: dict[str, float]
    ratio_vs_base: float
    speedup_vs_peft: float
    speedup_vs_hf: float
    all_modules: dict[str, float]
    rank_skew: RankSkew
    small_batches: list[SmallBatch]
    peak_rss_mb: float


def save_adapters(model: PreTrainedModel, names: list[str], modules: Sequence[str], root: Path) -> list[Path]:
    """Random non-zero rank-16 PEFT adapters (alpha 32), saved as users ship them."""
    peft: PeftModel | None = None
    for seed, name in enumerate(names):
        torch.manual_seed(seed)
        config = PeftLoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(modules), init_lora_weights=False)
        if peft is None:
            peft = get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
    assert peft is not None
    peft.save_pretrained(str(root), selected_adapters=names)
    return [root / name for name in names]


def peft_model(model: PreTrainedModel, names: list[str], dirs: list[Path]) -> PeftModel:
    """One PeftModel on a copy of the base holding every adapter, added through load_adapter."""
    peft = PeftModel.from_pretrained(copy.deepcopy(model), dirs[0], adapter_name=names[0])
    for name, directory in zip(names[1:], dirs[1:], strict=True):
        peft.load_adapter(directory, adapter_name=name)
    return peft.eval()


def run_generate(
    model: PreTrainedModel | PeftModel, pad: int, prompts: list[list[int]], new_tokens: int, **extra: object
) -> Run:
    assert isinstance(
        model, GenerationMixin | PeftModel
    )  # a causal LM's class mixes generate in; PreTrainedModel's has none
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=pad,
            **extra,
        )
    wall = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    ttft = clock.times[1] - start
    tpot = (clock.times[-1] - clock.times[1]) / max(1, new_tokens - 1)
    return {"wall_s": wall, "ttft_s": [ttft] * len(prompts), "tpot_s": [tpot] * len(prompts)}


def random_weights(shapes: ModelShapes, rank: int, seed: int) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    keys = [(layer, m) for layer in range(shapes.num_layers) for m in QV]
    a = {k: torch.randn(shapes.dims[k[1]][0], rank, generator=gen) * 0.02 for k in keys}
    b = {k: torch.randn(rank, shapes.dims[k[1]][1], generator=gen) * 0.02 for k in keys}
    return AdapterWeights(rank=rank, scale=2.0, a=a, b=b)


def engine_with(
    loaded: LoadedModel, lora: LoraConfig, batch: int, device: str = "cpu"
) -> tuple[LLMEngine, AdapterManager]:
    # Prefix caching off: base requests would share the chat template's K/V, which 32 requests on
    # 32 distinct adapters cannot, so ratio_vs_base would mix that in with the LoRA cost it measures.
    config = EngineConfig(
        kv_cache_bytes=320 * 2**20,
        max_model_len=512,
        max_num_seqs=max(64, batch),
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
        device=device,
    )
    manager = AdapterManager(lora, ModelShapes.from_hf_config(loaded.model.config), device=device)
    return LLMEngine.from_loaded(loaded, config, manager), manager


def start_decode(engine: LLMEngine, prompts: list[list[int]], adapters: list[str], steps: int) -> None:
    """Queue a batch and run its prefill step, leaving ``steps`` full decode steps."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, (p, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.add_request(EngineRequest(f"d{i}", p, params, adapter=adapter))
    engine.step()


def rank_skew(
    loaded: LoadedModel,
    probe: LimitsProbe,
    prompts: list[list[int]],
    steps: int,
    rounds: int,
    device: str = "cpu",
) -> RankSkew:
    """Median decode step: 31 rank-8 + 1 rank-64, and all rank-8 padded into a rank-64 pool, over 32 rank-8.

    The three batches run in three engines stepped in turn, so machine noise hits them alike.
    """
    batch = len(prompts)
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    unit = shapes.params_per_rank(QV) * 4 + 1  # bytes of one rank unit, rounded up
    mixed_pool = LoraConfig(
        rank_classes=(8, 64),
        class_shares=(8.0 * batch, 64.0),
        target_modules=QV,
        memory_budget_bytes=(8 * batch + 64) * unit,
        max_num_tokens=2048,
    )
    padded_pool = LoraConfig(
        rank_classes=(64,), target_modules=QV, memory_budget_bytes=64 * batch * unit, max_num_tokens=2048
    )
    rank8, mixed_manager = engine_with(loaded, mixed_pool, batch, device)
    skew = LLMEngine.from_loaded(loaded, rank8.config, mixed_manager)
    padded, padded_manager = engine_with(loaded, padded_pool, batch, device)
    names = [f"s{i}" for i in range(batch)]
    for i, name in enumerate(names):
        mixed_manager.load_adapter(name, random_weights(shapes, 8, i))
        padded_manager.load_adapter(name, random_weights(shapes, 8, i))
    mixed_manager.load_adapter("s64", random_weights(shapes, 64, batch))
    cases = {"rank8": (rank8, names), "skew": (skew, [*names[:-1], "s64"]), "padded": (padded, names)}
    since = probe.mark()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for engine, adapters in cases.values():
            start_decode(engine, prompts, adapters, steps)
        for _ in range(steps):
            for name, (engine, _) in cases.items():
                start = time.perf_counter()
                engine.step()
                times[name].append(time.perf_counter() - start)
        probe.sample()
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    floor = step_floor_ms(probe.limits(since), batch)
    return {
        "ratio": median["skew"] / median["rank8"],
        "padded_ratio": median["padded"] / median["rank8"],
        "step_ms": median,
        "step_spread_ms": {name: spread([x * 1e3 for x in t]) for name, t in times.items()},
        "step_vs_floor": {name: t / floor for name, t in median.items()},
    }


def small_batches(
    engine: LLMEngine,
    prompts: list[list[int]],
    names: dict[str, list[str]],
    sizes: list[int],
    new_tokens: int,
    rounds: int,
) -> list[SmallBatch]:
    """The engine alone at each small batch size: base, distinct q,v adapters and distinct all-seven
    adapters, once per round in rotating order (PEFT and HF are measured at the headline batch)."""
    rows: list[SmallBatch] = []
    for size in sizes:
        batch = prompts[:size]
        systems: dict[str, Callable[[], Run]] = {
            "base": partial(run_engine, engine, batch, new_tokens),
            "multilora": partial(run_engine, engine, batch, new_tokens, names["qv"][:size]),
            "multilora_all": partial(run_engine, engine, batch, new_tokens, names["all"][:size]),
        }
        order = list(systems)
        runs: dict[str, list[Run]] = {name: [] for name in order}
        for turn in range(rounds):
            for name in order[turn % len(order) :] + order[: turn % len(order)]:
                runs[name].append(systems[name]())
        summary = {name: summarise(r, size * new_tokens) for name, r in runs.items()}
        tok = {name: x["tok_s"] for name, x in summary.items()}
        tpot = {name: x["tpot_ms"]["p50"] for name, x in summary.items()}
        rows.append(
            {
                "batch": size,
                "tok_s": tok,
                "tpot_p50_ms": tpot,
                "ratio_vs_base": tok["multilora"] / tok["base"],
                "tpot_ratio_vs_base": tpot["base"] / tpot["multilora"],
                "all_modules_ratio_vs_base": tok["multilora_all"] / tok["base"],
            }
        )
    return rows


def throughput(
    loaded: LoadedModel,
    probe: LimitsProbe,
    prompts: list[list[int]],
    new_tokens: int,
    rounds: int,
    root: Path,
    device: str = "cpu",
    small: Sequence[int] = (),
) -> tuple[dict[str, Summary], list[SmallBatch]]:
    """All six runs once per round (base, multilora, peft, hf, then the all-seven-projection pair),
    the first to run rotating from round to round, the machine's limits probed after each round; then
    the engine alone at each ``small`` batch size."""
    batch = len(prompts)
    names = {"qv": [f"qv{i}" for i in range(batch)], "all": [f"all{i}" for i in range(batch)]}
    modules = {"qv": QV, "all": MODULES}
    dirs = {k: save_adapters(loaded.model, names[k], modules[k], root / k) for k in names}
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    budget = 2 * batch * RANK * shapes.params_per_rank(MODULES) * 4
    engine, manager = engine_with(
        loaded, LoraConfig(rank_classes=(RANK,), memory_budget_bytes=budget, max_num_tokens=2048), batch, device
    )
    for k in names:
        for name, directory in zip(names[k], dirs[k], strict=True):
            manager.load_adapter(name, directory)
    pefts = {k: peft_model(loaded.model, names[k], dirs[k]) for k in names}
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 2
    systems: dict[str, Callable[[], Run]] = {
        "base": lambda: run_engine(engine, prompts, new_tokens),
        "multilora": lambda: run_engine(engine, prompts, new_tokens, names["qv"]),
        "peft": lambda: run_generate(pefts["qv"], pad, prompts, new_tokens, adapter_names=names["qv"]),
        "hf": lambda: run_generate(loaded.model, pad, prompts, new_tokens),
        "multilora_all": lambda: run_engine(engine, prompts, new_tokens, names["all"]),
        "peft_all": lambda: run_generate(pefts["all"], pad, prompts, new_tokens, adapter_names=names["all"]),
    }
    run_engine(engine, prompts[:2], 2, [*names["qv"][:1], None])
    order = list(systems)
    runs: dict[str, list[Run]] = {name: [] for name in order}
    for turn in range(rounds):
        for name in order[turn % len(order) :] + order[: turn % len(order)]:
            runs[name].append(systems[name]())
        probe.sample()
    summaries = {name: summarise(r, batch * new_tokens) for name, r in runs.items()}
    return summaries, small_batches(engine, prompts, names, [b for b in small if b <= batch], new_tokens, rounds)


def table(result: Result) -> str:
    systems = result["systems"]
    lines = [
        f"Median of {result['rounds']} rounds (min-max); decode step floor at batch {result['batch_size']}: "
        f"{result['step_floor_ms']:.1f} ms",
        "",
        "| system | tok/s median (min-max) | vs base | TTFT p50 / p95 ms | TPOT p50 ms median (min-max) | "
        "TPOT p95 ms | TPOT / floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in systems.items():
        lines.append(
            f"| {name} | {spread_text(s['spread']['tok_s'])} | {s['tok_s'] / systems['base']['tok_s']:.2f}x | "
            f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p95']:.0f} | "
            f"{spread_text(s['spread']['tpot_p50_ms'])} | {s['tpot_ms']['p95']:.1f} | "
            f"{result['tpot_vs_floor'][name]:.1f}x |"
        )
    skew, every, batch = result["rank_skew"], result["all_modules"], result["batch_size"]
    lines += [
        "",
        "| figure | q,v (headline) | all seven | target |",
        "|---|---:|---:|---:|",
        f"| ratio_vs_base | {result['ratio_vs_base']:.2f} | {every['ratio_vs_base']:.2f} | >= 0.85 |",
        f"| speedup_vs_peft | {result['speedup_vs_peft']:.2f}x | {every['speedup_vs_peft']:.2f}x | >= 2.5x |",
        f"| speedup_vs_hf | {result['speedup_vs_hf']:.2f}x | | |",
        f"| adapter MB read per decode step (floor ms) | {result['lora_read_mb']['qv']:.0f} "
        f"({result['lora_floor_ms']['qv']:.1f}) | {result['lora_read_mb']['all']:.0f} "
        f"({result['lora_floor_ms']['all']:.1f}) | |",
        f"| TPOT added over base (ms) | {result['tpot_ms']['multilora']['p50'] - result['tpot_ms']['base']['p50']:.1f} "
        f"| {result['tpot_ms']['multilora_all']['p50'] - result['tpot_ms']['base']['p50']:.1f} | |",
        "",
        f"Rank skew (decode step): {batch - 1} x r8 + 1 x r64 = {skew['ratio']:.2f}x of {batch} x r8 "
        f"(target <= 1.15x); all padded to r64 = {skew['padded_ratio']:.2f}x; the r8 step is "
        f"{skew['step_vs_floor']['rank8']:.1f}x its floor. Peak RSS {result['peak_rss_mb']:.0f} MB.",
    ]
    if result["small_batches"]:
        lines += [
            "",
            "| small batch | base tok/s | multilora tok/s | ratio_vs_base (q,v) | TPOT base / multilora | "
            "all seven ratio_vs_base | target |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {row['batch']} | {row['tok_s']['base']:.1f} | {row['tok_s']['multilora']:.1f} | "
            f"{row['ratio_vs_base']:.2f} | {row['tpot_ratio_vs_base']:.2f} | {row['all_modules_ratio_vs_base']:.2f} "
            "| >= 0.9 |"
            for row in result["small_batches"]
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, finishes in under a minute")
    rounds_argument(parser)
    threads_argument(parser)
    device_argument(parser)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, new_tokens, skew_steps = (4, 4, 2) if args.quick else (32, 32, 6)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    loaded = load_model(device=args.device)
    probe = LimitsProbe(weights_of(loaded.model), torch.float32, args.device)
    print(roofline_line(probe.limits(), "float32", args.threads, args.device), flush=True)
    prompts = chat_prompts(loaded, batch)
    with tempfile.TemporaryDirectory() as root:
        systems, small = throughput(loaded, probe, prompts, new_tokens, rounds, Path(root), args.device, SMALL_BATCHES)
    limits = probe.limits()  # the probes around the headline rounds (rank_skew's own come after)
    skew = rank_skew(loaded, probe, prompts, skew_steps, rounds, args.device)
    print(probe.line(), flush=True)
    tok = {name: s["tok_s"] for name, s in systems.items()}
    floor = step_floor_ms(limits, batch)
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    lora_mb = {k: batch * RANK * shapes.params_per_rank(m) * 4 / 1e6 for k, m in (("qv", QV), ("all", MODULES))}
    result: Result = {
        "environment": {**environment(args.threads, "float32", args.device), "peft": peft_version},
        "quick": args.quick,
        "rounds": rounds,
        "headline": "median",
        "roofline": roofline(limits),
        "roofline_probes": probe.spread(),
        "batch_size": batch,
        "new_tokens": new_tokens,
        "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
        "adapters": batch,
        "rank_mix": {str(RANK): batch},
        "target_modules": list(QV),
        "systems": systems,
        "tok_s": tok,
        "ttft_ms": {name: s["ttft_ms"] for name, s in systems.items()},
        "tpot_ms": {name: s["tpot_ms"] for name, s in systems.items()},
        "step_floor_ms": floor,
        "tpot_vs_floor": {name: s["tpot_ms"]["p50"] / floor for name, s in systems.items()},
        "ratio_vs_base": tok["multilora"] / tok["base"],
        "speedup_vs_peft": tok["multilora"] / tok["peft"],
        "speedup_vs_hf": tok["multilora"] / tok["hf"],
        "lora_read_mb": lora_mb,
        "lora_floor_ms": {k: mb / limits["read_gb_s"] for k, mb in lora_mb.items()},  # MB / (GB/s) = ms
        "all_modules": {
            "ratio_vs_base": tok["multilora_all"] / tok["base"],
            "speedup_vs_peft": tok["multilora_all"] / tok["peft_all"],
        },
        "rank_skew": skew,
        "small_batches": small,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
