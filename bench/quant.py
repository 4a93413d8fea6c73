"""Weight-only int8 / int4 serving (LF_ENGINE__WEIGHTS) on the embedded SmolLM2-135M: speed and quality.

``python -m bench.quant [--quick] [--rounds N] [--threads N] [--group-size 32|64|128]``:

- batch-1 TPOT of the engine in fp32, bf16, and bf16 (and fp32) activations with int8 and int4 weights, one greedy
  request of 64 new tokens (16 with --quick) per system per round, the systems' order rotating from
  round to round; each figure is the median round, and each ratio is taken round by round (paired)
  against fp32 and bf16, then its median: the machine's state moves within minutes, so only systems
  that ran side by side are compared.
- quality against bf16 on bench.engine's chat prompts: bf16 generates 32 greedy tokens per prompt, then
  each system reads prompt + those tokens in one prefill; per generated token, the drift of its logprob
  (|logprob - bf16's|, mean and max) and whether the system's own argmax is that token (teacher-forced
  greedy agreement). fp32 is listed as the yardstick of bf16's own rounding.

Writes bench/results/quant.json and prints a Markdown table.

``python -m bench.quant --checkpoints [--rounds N] [--threads N]``: pre-quantized checkpoints against
bf16 on one seeded tiny-but-wide random Llama (hidden 1024, intermediate 4096, 4 layers, vocab 8192),
written as bf16 and by bench/prequant_writer.py as GPTQ int4, AWQ int4 and compressed-tensors int4 / int8
(groups of 128), beside bf16 quantized at load (LF_ENGINE__WEIGHTS): per system, in a fresh process
each round (systems rotating; one round unless --rounds), the time to load the model and build the bf16
engine, the process's RSS before (imports only) and after it and its peak, and batch-1 TPOT over 8
greedy tokens. Writes bench/results/quant_checkpoints.json.

``python -m bench.quant --checkpoints --moe``: the same on a tiny-but-wide random Qwen3-MoE (hidden 1024,
8 experts of width 1408, top 2, 4 layers, vocab 8192), every expert quantized as its own module (bf16
quantized at load is not a system there: LF_ENGINE__WEIGHTS does not quantize experts). Writes
bench/results/quant_checkpoints_moe.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch

from bench.engine import chat_prompts, run_engine
from bench.environment import environment, rounds_argument, threads_argument
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.batch import build_batch
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.sequence import Sequence
from shared import heap
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "quant.json"
CHECKPOINT_RESULTS = Path(__file__).parent / "results" / "quant_checkpoints.json"
MOE_CHECKPOINT_RESULTS = Path(__file__).parent / "results" / "quant_checkpoints_moe.json"
# checkpoint directory and LF_ENGINE__WEIGHTS of each system of --checkpoints
CHECKPOINT_SYSTEMS: dict[str, tuple[str, Literal["none", "int8", "int4"]]] = {
    "bf16": ("bf16", "none"),
    "bf16, int4 at load": ("bf16", "int4"),
    "gptq int4": ("gptq", "none"),
    "awq int4": ("awq", "none"),
    "compressed-tensors int4": ("ct-int4", "none"),
    "compressed-tensors int8": ("ct-int8", "none"),
}
Dtype = Literal["float32", "bfloat16"]
SYSTEMS: dict[str, tuple[Dtype, Literal["none", "int8", "int4"]]] = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "int8 fp32": ("float32", "int8"),  # fp32 activations: the native small-row kernels' fp32 paths
    "int4 fp32": ("float32", "int4"),
}
QUALITY_TOKENS = 32


def engines(models: dict[Dtype, LoadedModel], group_size: int, threads: int) -> dict[str, LLMEngine]:
    built = {}
    for name, (dtype, weights) in SYSTEMS.items():
        config = EngineConfig(
            dtype=dtype,
            weights=weights,
            weight_group_size=group_size,  # type: ignore[arg-type]  # argparse's choices
            kv_cache_bytes=64 * 2**20,
            max_model_len=512,
            max_num_batched_tokens=512,
            num_threads=threads,
            compute_nice=0,  # the machine may be shared: a niced step loop measures the neighbours
        )
        built[name] = LLMEngine.from_loaded(models[dtype], config)
    return built


def tpot(built: dict[str, LLMEngine], prompts: list[list[int]], new_tokens: int, rounds: int) -> dict[str, object]:
    names = list(built)
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {}
        for name in order:
            run = run_engine(built[name], [prompts[r % len(prompts)]], new_tokens)
            times[name] = run["tpot_s"][0] * 1e3
        per_round.append(times)
    result: dict[str, object] = {
        "tpot_ms": {n: statistics.median(t[n] for t in per_round) for n in names},
        "tpot_ms_min_max": {n: (min(t[n] for t in per_round), max(t[n] for t in per_round)) for n in names},
    }
    for base in ("fp32", "bf16"):
        result[f"speedup_vs_{base}"] = {n: statistics.median(t[base] / t[n] for t in per_round) for n in names}
    return result


def _every_token_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """One prefill of ``ids`` through the engine's forward: fp32 log-softmax at every position [len, vocab]."""
    seq = Sequence(EngineRequest("q", ids), None)  # type: ignore[arg-type]  # no detokeniser needed
    engine.reset_prefix_cache()  # every position computed, none read from an earlier prompt's blocks
    engine.blocks.allocate(seq)
    batch = build_batch([], [seq], engine.config.kv_block_size, engine.config.device)
    logits = engine.model.forward(
        batch.input_ids, batch.positions, batch.meta, engine.cache, torch.arange(batch.input_ids.shape[0])
    )
    engine.blocks.commit()
    engine.blocks.free(seq)
    engine.reset_prefix_cache()
    return logits.log_softmax(-1)


def quality(built: dict[str, LLMEngine], prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    params = SamplingParams(max_tokens=QUALITY_TOKENS, temperature=0.0, ignore_eos=True)
    drift: dict[str, list[float]] = {n: [] for n in built if n != "bf16"}
    agree: dict[str, list[bool]] = {n: [] for n in drift}
    for i, prompt in enumerate(prompts):
        reference = built["bf16"]
        reference.add_request(EngineRequest(f"g{i}", prompt, params))
        generated: list[int] = []
        while reference.has_unfinished():
            for out in reference.step():
                generated.extend(out.token_ids)
        ids = prompt + generated
        positions = torch.arange(len(prompt) - 1, len(ids) - 1)
        target = torch.tensor(generated)
        base = _every_token_logprobs(reference, ids)[positions].gather(1, target[:, None])[:, 0]
        for name in drift:
            logprobs = _every_token_logprobs(built[name], ids)[positions]
            drift[name] += (logprobs.gather(1, target[:, None])[:, 0] - base).abs().tolist()
            agree[name] += (logprobs.argmax(-1) == target).tolist()
    return {
        n: {
            "logprob_drift_mean": statistics.fmean(drift[n]),
            "logprob_drift_max": max(drift[n]),
            "greedy_agreement": sum(agree[n]) / len(agree[n]),
            "tokens": len(agree[n]),
        }
        for n in drift
    }


def table(speed: dict[str, object], good: dict[str, dict[str, float]]) -> str:
    tpots = speed["tpot_ms"]
    assert isinstance(tpots, dict)
    vs32, vs16 = speed["speedup_vs_fp32"], speed["speedup_vs_bf16"]
    assert isinstance(vs32, dict) and isinstance(vs16, dict)
    lines = [
        "| system | batch-1 TPOT (ms) | x fp32 | x bf16 | logprob drift vs bf16 (mean / max) | greedy agreement vs bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for name in SYSTEMS:
        q = good.get(name)
        quality_cells = (
            f"{q['logprob_drift_mean']:.4f} / {q['logprob_drift_max']:.3f} | {100 * q['greedy_agreement']:.1f}%"
            if q
            else "- | -"
        )
        lines.append(f"| {name} | {tpots[name]:.1f} | {vs32[name]:.2f} | {vs16[name]:.2f} | {quality_cells} |")
    return "\n".join(lines)


def write_checkpoints(root: Path, moe: bool = False) -> None:
    """The wide random Llama (``moe``: Qwen3-MoE) saved in bf16 and in each pre-quantized format, under ``root``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerFast,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from bench.prequant_writer import write_awq, write_compressed_tensors, write_gptq

    torch.manual_seed(0)
    shape: dict[str, Any] = {
        "vocab_size": 8192,
        "hidden_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
    }
    experts: dict[str, Any] = {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 1408,
        "norm_topk_prob": True,
        "head_dim": 64,
    }
    plain: PreTrainedModel = (
        Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **experts))
        if moe
        else LlamaForCausalLM(LlamaConfig(**shape, intermediate_size=4096))
    )
    model = plain.to(torch.bfloat16).eval()  # type: ignore[arg-type]  # transformers' wrapped .to
    config = model.config
    core = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # type: ignore[assignment]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0")
    writers = {
        "bf16": lambda d: None,
        "gptq": lambda d: write_gptq(model, d, 128, symmetric=True),
        "awq": lambda d: write_awq(model, d, 128),
        "ct-int4": lambda d: write_compressed_tensors(model, d, "pack-quantized", 4, 128),
        "ct-int8": lambda d: write_compressed_tensors(model, d, "pack-quantized", 8),
    }
    for name, write in writers.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        write(root / name)


def load_child(directory: str, weights: Literal["none", "int8", "int4"], threads: int) -> None:
    """One system in this fresh process: load, build the engine, decode; prints its figures as JSON."""
    torch.set_num_threads(threads)
    before_mb = _rss_mb()
    start = time.perf_counter()
    loaded = load_model(directory, dtype=torch.bfloat16)
    config = EngineConfig(
        dtype="bfloat16",
        weights=weights,
        weight_group_size=128,
        kv_cache_bytes=16 * 2**20,
        max_model_len=256,
        max_num_batched_tokens=256,
        num_threads=threads,
        compute_nice=0,
    )
    engine = LLMEngine.from_loaded(loaded, config)
    del loaded  # as the worker drops it: what stays is what the engine holds
    heap.trim()  # and as it gives the load's freed memory back
    load_s = time.perf_counter() - start
    rss_mb = _rss_mb()
    run = run_engine(engine, [list(range(5, 37))], 8)
    # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec
    peak_mb = _status_mb("VmHWM")
    figures = {"load_s": load_s, "rss_before_mb": before_mb, "rss_mb": rss_mb, "peak_rss_mb": peak_mb}
    print(json.dumps({**figures, "tpot_ms": run["tpot_s"][0] * 1e3}))


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _status_mb(field: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def checkpoints(rounds: int, threads: int, moe: bool = False) -> None:
    names = [n for n in CHECKPOINT_SYSTEMS if not (moe and CHECKPOINT_SYSTEMS[n][1] != "none")]
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="lf-prequant-") as tmp:
        root = Path(tmp)
        write_checkpoints(root, moe)
        sizes = {
            d: sum(f.stat().st_size for f in (root / d).glob("*.safetensors")) / 2**20
            for d in {CHECKPOINT_SYSTEMS[n][0] for n in names}
        }
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                directory, weights = CHECKPOINT_SYSTEMS[name]
                command = [
                    sys.executable,
                    "-m",
                    "bench.quant",
                    "--load-child",
                    str(root / directory),
                    "--weights",
                    weights,
                ]
                out = subprocess.run([*command, "--threads", str(threads)], capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    figures = {
        name: {
            "checkpoint_mb": sizes[CHECKPOINT_SYSTEMS[name][0]],
            **{k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]},
        }
        for name in names
    }
    result = {"environment": environment(threads, "bfloat16"), "rounds": rounds, "systems": figures}
    path = MOE_CHECKPOINT_RESULTS if moe else CHECKPOINT_RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    base = figures["bf16"]
    model_name = "Qwen3-MoE (hidden 1024, 8 experts of 1408, top 2" if moe else "Llama (hidden 1024"
    print(f"\n## Wide random {model_name}, 4 layers), bf16 engine, median of {rounds} fresh process(es)\n")
    print(
        "| system | checkpoint (MB) | load + engine (s) | x bf16 | RSS before / after load (MB) | "
        "model RSS (MB) | x bf16 | peak RSS (MB) | TPOT (ms) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base_model = base["rss_mb"] - base["rss_before_mb"]
    for name, f in figures.items():
        model = f["rss_mb"] - f["rss_before_mb"]
        print(
            f"| {name} | {f['checkpoint_mb']:.0f} | {f['load_s']:.2f} | {f['load_s'] / base['load_s']:.2f} | "
            f"{f['rss_before_mb']:.0f} / {f['rss_mb']:.0f} | {model:.0f} | {model / base_model:.2f} | "
            f"{f['peak_rss_mb']:.0f} | {f['tpot_ms']:.1f} |"
        )
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and prompts")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32, help="int4 group size")
    parser.add_argument("--checkpoints", action="store_true", help="pre-quantized checkpoints' load time and RSS")
    parser.add_argument("--moe", action="store_true", help="--checkpoints on a mixture-of-experts model")
    parser.add_argument("--load-child", help=argparse.SUPPRESS)
    parser.add_argument("--weights", default="none", help=argparse.SUPPRESS)
    rounds_argument(parser)
    threads_argument(parser)
    args = parser.parse_args()
    if args.load_child:
        load_child(args.load_child, args.weights, args.threads)
        return
    if args.checkpoints:
        checkpoints(args.rounds or 1, args.threads, args.moe)
        return
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    new_tokens, count = (16, 4) if args.quick else (64, 16)
    models: dict[Dtype, LoadedModel] = {d: load_model(None, dtype=getattr(torch, d)) for d in ("float32", "bfloat16")}
    prompts = chat_prompts(models["float32"], count)
    built = engines(models, args.group_size, args.threads)
    speed = tpot(built, prompts, new_tokens, rounds)
    good = quality(built, prompts)
    result = {
        "environment": environment(args.threads, "bfloat16"),
        "rounds": rounds,
        "new_tokens": new_tokens,
        "group_size": args.group_size,
        "speed": speed,
        "quality_vs_bf16": good,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(f"\n## SmolLM2-135M, batch 1, {new_tokens} tokens, median of {rounds} rounds (ratios paired per round)\n")
    print(table(speed, good))
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
