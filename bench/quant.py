"""Weight-only int8 / int4 serving (LF_ENGINE__WEIGHTS) on the embedded SmolLM2-135M: speed and quality.

``python -m bench.quant [--quick] [--rounds N] [--threads N] [--group-size 32|64|128]``:

- batch-1 TPOT of the engine in fp32, bf16, and bf16 activations with int8 and int4 weights, one greedy
  request of 64 new tokens (16 with --quick) per system per round, the systems' order rotating from
  round to round; each figure is the median round, and each ratio is taken round by round (paired)
  against fp32 and bf16, then its median: the machine's state moves within minutes, so only systems
  that ran side by side are compared.
- quality against bf16 on bench.engine's chat prompts: bf16 generates 32 greedy tokens per prompt, then
  each system reads prompt + those tokens in one prefill; per generated token, the drift of its logprob
  (|logprob - bf16's|, mean and max) and whether the system's own argmax is that token (teacher-forced
  greedy agreement). fp32 is listed as the yardstick of bf16's own rounding.

Writes bench/results/quant.json and prints a Markdown table.
"""

import argparse
import json
import statistics
from pathlib import Path
from typing import Literal

import torch

from bench.engine import chat_prompts, run_engine
from bench.environment import environment, rounds_argument, threads_argument
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.batch import build_batch
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.sequence import Sequence
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "quant.json"
Dtype = Literal["float32", "bfloat16"]
SYSTEMS: dict[str, tuple[Dtype, Literal["none", "int8", "int4"]]] = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and prompts")
    parser.add_argument("--group-size", type=int, choices=(32, 64, 128), default=32, help="int4 group size")
    rounds_argument(parser)
    threads_argument(parser)
    args = parser.parse_args()
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
