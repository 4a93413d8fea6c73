"""Base-model throughput of the engine against transformers ``generate``, and memory at 64 x 512 tokens.

``python -m bench.engine [--quick] [--rounds N] [--threads N] [--device cuda [--cuda-graphs]]``: the
machine's roofline first (read bandwidth, GEMM FLOP/s and the decode floors they set). Then for each
batch size, the same chat prompts (20-60 tokens) run through HF generate (left-padded batch, EOS
suppressed by min_new_tokens) and the engine (ignore_eos), fp32 (``--dtype``: each dtype named), in 5
rounds (3 with --quick) in which every system of every dtype runs once, the order rotating from round to
round; each figure is the median round, with min and max beside it, and each TPOT is also a multiple of
its decode step floor. A dtype other than fp32 is also compared with fp32 round by round: this host's
memory bandwidth moves by 2x within minutes, so dtypes run one after the other compared two states of
the machine (bf16 / fp32 at batch 32 read 1.50x across two halves that probed 56 and 33 GB/s, and
1.61x in interleaved pairs). ``--cuda-graphs``
adds the engine replaying CUDA graphs of its decode steps, and its tok/s ratio to the eager engine's.
Then a fresh process holds 64 sequences of 512 tokens at once and reports its peak RSS beside the KV
budget and the model size.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict, cast

import torch
from transformers import GenerationMixin, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from bench.environment import device_argument, environment, rounds_argument, threads_argument
from bench.roofline import LimitsProbe, roofline, roofline_line, step_floor_ms, weights_of
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS, Run, Spread, Summary, spread, spread_text, summarise
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.weights import spec_of
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine.json"


class ThroughputRow(TypedDict):
    batch: int
    new_tokens: int
    prompt_tokens: list[int]
    systems: dict[str, Summary]
    speedup_vs_hf: float
    speedup_vs_hf_no_prefix_cache: float
    tpot_ratio_vs_hf: float
    step_floor_ms: float
    tpot_vs_floor: dict[str, float]  # each system's median TPOT p50 / step_floor_ms
    cuda_graphs_speedup: NotRequired[float]  # engine_cuda_graphs tok/s / engine tok/s, with --cuda-graphs
    vs_float32: NotRequired[dict[str, Spread]]  # another dtype's engine over fp32's, round by round (paired_vs)


TOPICS = [
    "the sea",
    "a red fox",
    "prime numbers",
    "the moon",
    "coffee",
    "rain in spring",
    "a lighthouse",
    "bread",
    "trains",
    "a chess game",
    "autumn leaves",
    "volcanoes",
    "bees",
    "the desert",
    "a violin",
    "snow",
]
STYLES = [
    "Write a haiku about {}.",
    "Explain {} to a child in two short sentences, please.",
    "Give me three surprising facts about {}, each in one line, and keep the tone light and friendly.",
]


def chat_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """One user message in the model's chat template, as token ids."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # typed as the union of every mode's result: one chat, tokenised, without a dict, is its id list
    return cast(list[int], ids)


def chat_prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    texts = [STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)]) for i in range(count)]
    return [chat_ids(loaded.tokenizer, t) for t in texts]


class StepClock(BaseStreamer):
    """Timestamps each generate step (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int) -> Run:
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 2
    model = loaded.model
    assert isinstance(model, GenerationMixin)  # a causal LM's class mixes generate in; PreTrainedModel's has none
    width = max(len(p) for p in prompts)
    device = next(loaded.model.parameters()).device
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
        )
    wall = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    ttft = clock.times[1] - start
    tpot = (clock.times[-1] - clock.times[1]) / max(1, new_tokens - 1)
    return {"wall_s": wall, "ttft_s": [ttft] * len(prompts), "tpot_s": [tpot] * len(prompts)}


def run_engine(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int, adapters: Sequence[str | None] | None = None
) -> Run:
    """One batch through the engine (each request with its adapter, or base), EOS ignored."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()  # nothing carried over from an earlier round or batch
    hits_before = engine.blocks.hit_tokens
    start, mono_start = time.perf_counter(), time.monotonic()
    for i, p in enumerate(prompts):
        engine.add_request(EngineRequest(f"r{i}", p, params, adapter=adapters[i] if adapters else None))
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.first_token_time is not None:  # set from the request's first token on
                first.setdefault(out.request_id, out.first_token_time)
            if out.finished:
                done[out.request_id] = time.monotonic()
                assert out.completion_tokens == new_tokens
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "ttft_s": [first[r] - mono_start for r in first],
        "tpot_s": [(done[r] - first[r]) / max(1, new_tokens - 1) for r in first],
        "prefix_hit_tokens": engine.blocks.hit_tokens - hits_before,
        "prompt_tokens": sum(map(len, prompts)),
    }


@dataclass
class Setup:
    """One dtype's model, its limits probe (in that dtype) and its engines, run in the same rounds as the
    other dtypes' so that their ratios compare the machine in one state."""

    dtype: str
    loaded: LoadedModel
    probe: LimitsProbe
    engines: dict[str, LLMEngine]


def setup(dtype: str, device: str, linear_split: bool, cuda_graphs: bool) -> Setup:
    """The model loaded in ``dtype`` (as the worker loads it) and its engines. "engine_no_prefix_cache"
    computes every prompt token, like transformers; ``linear_split`` adds the engine on plain F.linear
    ("engine_f_linear"), ``cuda_graphs`` the engine replaying CUDA graphs of its decode steps
    ("engine_cuda_graphs")."""
    loaded = load_model(dtype=getattr(torch, dtype), device=device)
    variants = {
        "engine": ("auto", True, False),
        "engine_no_prefix_cache": ("auto", False, False),
        **({"engine_f_linear": ("torch", True, False)} if linear_split else {}),
        **({"engine_cuda_graphs": ("auto", True, True)} if cuda_graphs else {}),
    }
    engines = {
        name: LLMEngine.from_loaded(
            loaded,
            EngineConfig(
                kv_cache_bytes=512 * 2**20,
                max_model_len=512,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                dtype=dtype,
                device=device,
                cpu_linear=linear,
                enable_prefix_caching=prefix,
                cuda_graphs=graphs,
            ),
        )
        for name, (linear, prefix, graphs) in variants.items()
    }
    return Setup(dtype, loaded, LimitsProbe(weights_of(loaded.model), getattr(torch, dtype), device), engines)


def throughput(setups: list[Setup], batches: list[int], new_tokens: int, rounds: int) -> dict[str, list[ThroughputRow]]:
    """Per dtype, its rows. Every system of every dtype runs once per round, the first to run rotating
    from round to round, and each dtype's limits are probed after each round (each batch's floor from
    the median of the probes around its own rounds). Every round starts from an empty prefix cache: the
    engine shares only what one batch's own prompts have in common (the chat template). With float32
    among the dtypes, each other dtype's rows carry ``vs_float32``: its engine against float32's engine
    round by round, both having run in the same round."""
    rows: dict[str, list[ThroughputRow]] = {s.dtype: [] for s in setups}
    for batch in batches:
        prompts = chat_prompts(setups[0].loaded, batch)
        for s in setups:
            for engine in s.engines.values():
                run_engine(engine, prompts[:1], 2)
        order = [(s, name) for s in setups for name in ["hf", *s.engines]]
        runs: dict[tuple[str, str], list[Run]] = {(s.dtype, name): [] for s, name in order}
        since = {s.dtype: s.probe.mark() for s in setups}
        for turn in range(rounds):
            shift = turn % len(order)
            for s, name in order[shift:] + order[:shift]:
                run = (
                    run_hf(s.loaded, prompts, new_tokens)
                    if name == "hf"
                    else run_engine(s.engines[name], prompts, new_tokens)
                )
                runs[(s.dtype, name)].append(run)
            for s in setups:
                s.probe.sample()
        total = batch * new_tokens
        for s in setups:
            systems = {name: summarise(runs[(s.dtype, name)], total) for name in ["hf", *s.engines]}
            floor = step_floor_ms(s.probe.limits(since[s.dtype]), batch)
            row: ThroughputRow = {
                "batch": batch,
                "new_tokens": new_tokens,
                "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
                "systems": systems,
                "speedup_vs_hf": systems["engine"]["tok_s"] / systems["hf"]["tok_s"],
                "speedup_vs_hf_no_prefix_cache": systems["engine_no_prefix_cache"]["tok_s"] / systems["hf"]["tok_s"],
                "tpot_ratio_vs_hf": systems["engine"]["tpot_ms"]["p50"] / systems["hf"]["tpot_ms"]["p50"],
                "step_floor_ms": floor,
                "tpot_vs_floor": {name: sy["tpot_ms"]["p50"] / floor for name, sy in systems.items()},
            }
            if "engine_cuda_graphs" in s.engines:
                row["cuda_graphs_speedup"] = systems["engine_cuda_graphs"]["tok_s"] / systems["engine"]["tok_s"]
            if s.dtype != "float32" and ("float32", "engine") in runs:
                row["vs_float32"] = paired_vs(runs[(s.dtype, "engine")], runs[("float32", "engine")])
            rows[s.dtype].append(row)
    return rows


def paired_vs(runs: list[Run], base: list[Run]) -> dict[str, Spread]:
    """Round by round, how much faster ``runs`` were than ``base`` (both > 1 when faster): tok/s (the
    same tokens, so base's wall over this one's) and TPOT p50 (base's over this one's)."""
    tok_s = [b["wall_s"] / r["wall_s"] for r, b in zip(runs, base, strict=True)]
    tpot = [statistics.median(b["tpot_s"]) / statistics.median(r["tpot_s"]) for r, b in zip(runs, base, strict=True)]
    return {"tok_s": spread(tok_s), "tpot": spread(tpot)}


def rss_probe(num_seqs: int, seq_len: int, threads: int) -> dict[str, object]:
    """Run in a fresh process: hold ``num_seqs`` sequences of ``seq_len`` tokens at once."""
    torch.set_num_threads(threads)
    loaded = load_model()
    model_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    generated = min(32, seq_len // 2)  # long enough that the first sequences still run when the last joins
    prompt_len = seq_len - generated
    budget = num_seqs * seq_len * spec_of(loaded.model.config).kv_bytes_per_token(torch.float32)
    config = EngineConfig(
        kv_cache_bytes=budget,
        kv_block_size=16,
        max_model_len=seq_len,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(2048, seq_len),
    )
    engine = LLMEngine.from_loaded(loaded, config)
    rss_loaded_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = SamplingParams(max_tokens=generated, temperature=0.0, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(EngineRequest(str(i), [(7 * i + j) % 40000 + 100 for j in range(prompt_len)], params))
    concurrent = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        concurrent = max(concurrent, len(engine.scheduler.running))
    return {
        "num_seqs": num_seqs,
        "seq_len": seq_len,
        "max_concurrent": concurrent,
        "kv_budget_mib": engine.cache.nbytes / 2**20,
        "model_mib": model_bytes / 2**20,
        "rss_after_load_mib": rss_loaded_mib,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "wall_s": time.perf_counter() - start,
    }


def table(rows: list[ThroughputRow], memory: dict[str, object]) -> str:
    lines = [
        "| batch | system | tok/s median (min-max) | speedup vs hf | TTFT p50 / p95 ms | "
        "TPOT p50 ms median (min-max) | TPOT p95 ms | TPOT / floor |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name, s in row["systems"].items():
            speed = f"{s['tok_s'] / row['systems']['hf']['tok_s']:.2f}x"
            lines.append(
                f"| {row['batch']} | {name} | {spread_text(s['spread']['tok_s'])} | {speed} | "
                f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p95']:.0f} | "
                f"{spread_text(s['spread']['tpot_p50_ms'])} | {s['tpot_ms']['p95']:.1f} | "
                f"{row['tpot_vs_floor'][name]:.1f}x |"
            )
    lines.append("")
    lines += [f"batch {row['batch']}: decode step floor {row['step_floor_ms']:.1f} ms" for row in rows]
    lines += [
        f"batch {row['batch']}: CUDA graphs {row['cuda_graphs_speedup']:.2f}x the eager engine's tok/s"
        for row in rows
        if "cuda_graphs_speedup" in row
    ]
    for row in rows:
        s = row["systems"]["engine"]
        lines.append(
            f"batch {row['batch']}: the prefix cache shared {s['prefix_hit_tokens']} of {s['prompt_tokens']} "
            f"prompt tokens (a cold cache each round)"
        )
    lines.append(
        f"Memory: {memory['num_seqs']} seqs x {memory['seq_len']} tokens (max {memory['max_concurrent']} "
        f"concurrent): peak RSS {memory['peak_rss_mib']:.0f} MiB vs KV budget {memory['kv_budget_mib']:.0f} "
        f"MiB + model {memory['model_mib']:.0f} MiB (RSS after load {memory['rss_after_load_mib']:.0f} MiB)"
    )
    return "\n".join(lines)


def memory_probe(threads: int, quick: bool) -> dict[str, object]:
    seqs, seq_len = (64, 32) if quick else (64, 512)
    probe = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--threads", str(threads), "--rss-probe", str(seqs), str(seq_len)],
        capture_output=True,
        text=True,
        check=True,
    )
    return cast(dict[str, object], json.loads(probe.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, finishes in under a minute")
    rounds_argument(parser)
    threads_argument(parser)
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=("float32", "bfloat16"),
        default=["float32"],
        help="dtype(s) of both systems, all in the same rounds (bf16 uses this CPU's avx512_bf16 / AMX where "
        "present); the model is loaded in each dtype, as the worker does",
    )
    parser.add_argument(
        "--linear-split",
        action="store_true",
        help="also run the engine on plain F.linear, to separate the oneDNN matmuls' share",
    )
    device_argument(parser)
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also run the engine with EngineConfig.cuda_graphs (decode steps replayed as CUDA graphs; --device cuda)",
    )
    parser.add_argument("--out", type=Path, help=f"result file (default {RESULTS}; other dtypes get -<dtype>)")
    parser.add_argument("--rss-probe", nargs=2, type=int, metavar=("SEQS", "LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda")
    if args.rss_probe:
        num_seqs, seq_len = args.rss_probe
        print(json.dumps(rss_probe(num_seqs, seq_len, args.threads)))
        return
    torch.set_num_threads(args.threads)
    batches, new_tokens = ([1, 32], 8) if args.quick else ([1, 8, 32], 64)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    dtypes = sorted(set(args.dtype), key=lambda d: d != "float32")  # fp32 first: the others are compared with it
    # first, while this process holds no model: a child's peak RSS starts from its parent's at the fork
    memory = memory_probe(args.threads, args.quick)
    setups = [setup(dtype, args.device, args.linear_split, args.cuda_graphs) for dtype in dtypes]
    for s in setups:
        print(roofline_line(s.probe.limits(), s.dtype, args.threads, args.device), flush=True)
    done = throughput(setups, batches, new_tokens, rounds)
    for s in setups:
        rows = done[s.dtype]
        print(f"{s.dtype}: {s.probe.line()}", flush=True)
        result = {
            "environment": environment(args.threads, s.dtype, args.device),
            "quick": args.quick,
            "rounds": rounds,
            "headline": "median",
            "dtypes_interleaved": dtypes,  # every dtype here ran in the same rounds
            "roofline": roofline(s.probe.limits()),
            "roofline_probes": s.probe.spread(),
            "throughput": rows,
            "memory": memory,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "adapters": 0,
            "rank_mix": None,
        }
        if any("vs_float32" in row for row in rows):  # the median round's ratios, by batch
            result["vs_float32"] = {
                row["batch"]: {name: figure["median"] for name, figure in row["vs_float32"].items()}
                for row in rows
                if "vs_float32" in row
            }
        path = args.out or RESULTS
        if s.dtype != "float32":
            path = path.with_name(f"{path.stem}-{s.dtype}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"\n## {s.dtype}: median of {rounds} rounds (min-max)\n")
        print(table(rows, memory))
        for row in rows:
            if "vs_float32" in row:
                ratio = row["vs_float32"]
                print(
                    f"{s.dtype} vs float32, batch {row['batch']}, round by round: engine tok/s "
                    f"{spread_text(ratio['tok_s'], 2)}x, decode TPOT p50 {spread_text(ratio['tpot'], 2)}x faster"
                )
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
