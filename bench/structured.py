"""Structured outputs: the step-time cost of per-row grammar masks, and grammar compile time.

``python -m bench.structured [--quick]``: SmolLM2 fp32 in process, the engine alone. A batch of 32
requests, every one under a different JSON schema, against the same 32 prompts unconstrained, in
interleaved rounds in the same run (the arm that goes first alternates); only steps that decode
all 32 rows (no prefill, nobody finished) are compared, and the free rows ignore EOS so that both
arms decode every round's tokens. Besides the ratio of the two arms' p50s, each round's own ratio
(its two arms run back to back), and the ratio of the steps' process CPU times, which a machine
shared with others disturbs less than wall time (most steadily with ``--threads 1``). Compile time is per schema, cold (first compile) and cached (by digest).
Target: constrained step time <= 1.10x unconstrained.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.engine import chat_prompts
from bench.environment import environment, load_average
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.model_loader import LoadedModel, load_model
from shared.schemas import SamplingParams, StructuredOutput

RESULTS = Path(__file__).parent / "results" / "structured.json"
BATCH = 32


def schema(i: int) -> dict:
    """A different schema per request: names, enums, nesting and array bounds vary with ``i``."""
    text = {"type": "string", "maxLength": 40 + i}
    return {
        "type": "object",
        "title": f"record{i}",
        "properties": {
            f"name_{i}": text,
            "kind": {"enum": [f"k{i}", f"k{i + 1}", "other"]},
            "tags": {"type": "array", "items": text, "maxItems": 4 + i % 5},
            "where": {
                "type": "object",
                "properties": {"city": text, "zip": {"type": "integer", "minimum": 0, "maximum": 99_999}},
                "required": ["city"],
            },
        },
        "required": [f"name_{i}", "kind", "tags", "where"],
        "additionalProperties": False,
    }


def specs() -> list[StructuredOutput]:
    return [StructuredOutput(kind="json_schema", json_schema=json.dumps(schema(i))) for i in range(BATCH)]


def compile_times(engine: LLMEngine, structured: list[StructuredOutput]) -> dict[str, float]:
    engine.grammars.compile(StructuredOutput(kind="json_object"))  # the tokenizer info, built once per engine
    cold, cached = [], []
    for spec in structured:
        started = time.perf_counter()
        engine.grammars.compile(spec)
        cold.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        engine.grammars.compile(spec)
        cached.append((time.perf_counter() - started) * 1000)
    return {
        "cold_ms_p50": statistics.median(cold),
        "cold_ms_max": max(cold),
        "cached_ms_p50": statistics.median(cached),
        "cached_ms_max": max(cached),
    }


def full_decode_steps(
    engine: LLMEngine, prompts: list[list[int]], structured: list[StructuredOutput] | None, tokens: int
) -> list[tuple[float, float]]:
    """(wall, process CPU) times (ms) of the steps that decode every one of the batch's rows."""
    for i, ids in enumerate(prompts):
        spec = structured[i] if structured is not None else None
        params = SamplingParams(
            max_tokens=tokens, temperature=0.8, seed=i, structured=spec, ignore_eos=structured is None
        )
        engine.add_request(EngineRequest(f"{'s' if structured else 'f'}{i}-{time.monotonic_ns()}", ids, params))
    times = []
    while engine.has_unfinished():
        full = not engine.scheduler.waiting and all(s.num_new_tokens == 1 for s in engine.scheduler.running)
        full = full and len(engine.scheduler.running) == len(prompts)
        started, cpu = time.perf_counter(), time.process_time()
        outputs = engine.step()
        elapsed = ((time.perf_counter() - started) * 1000, (time.process_time() - cpu) * 1000)
        if full and not any(o.finished for o in outputs):
            times.append(elapsed)
    return times


def mask_time(engine: LLMEngine, prompts: list[list[int]], structured: list[StructuredOutput]) -> float:
    """The masks' own share: fill and apply 32 rows' bitmasks on a [32, vocab] logits tensor (ms)."""
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(f"m{i}", ids, SamplingParams(max_tokens=1, structured=structured[i])))
    seqs = list(engine.scheduler.waiting)
    logits = torch.randn(len(seqs), engine.vocab_size)
    runs = []
    for _ in range(20):
        started = time.perf_counter()
        engine.grammars.mask(logits, seqs)
        runs.append((time.perf_counter() - started) * 1000)
    for seq in seqs:
        engine.abort(seq.request_id)
    return statistics.median(runs)


def run(loaded: LoadedModel, rounds: int, tokens: int) -> dict[str, object]:
    config = EngineConfig(
        max_num_seqs=BATCH, max_model_len=512, kv_cache_bytes=256 * 2**20, enable_prefix_caching=False
    )
    engine = LLMEngine.from_loaded(loaded, config)
    structured = specs()
    compiles = compile_times(engine, structured)
    prompts = chat_prompts(loaded, BATCH)
    free: list[tuple[float, float]] = []
    constrained: list[tuple[float, float]] = []
    round_ratios = []
    for r in range(rounds):
        arms = [(free, None), (constrained, structured)]
        steps = {}
        for times, spec in arms if r % 2 == 0 else arms[::-1]:
            steps[spec is None] = full_decode_steps(engine, prompts, spec, tokens)
            times += steps[spec is None]
        round_ratios.append(
            statistics.median(w for w, _ in steps[False]) / statistics.median(w for w, _ in steps[True])
        )
    free_ms, constrained_ms = statistics.median(w for w, _ in free), statistics.median(w for w, _ in constrained)
    free_cpu, constrained_cpu = statistics.median(c for _, c in free), statistics.median(c for _, c in constrained)
    return {
        "batch": BATCH,
        "distinct_schemas": len({s.json_schema for s in structured}),
        "rounds": rounds,
        "steps_compared": {"free": len(free), "constrained": len(constrained)},
        "step_ms_p50": {"free": free_ms, "constrained": constrained_ms},
        "overhead_ratio": constrained_ms / free_ms,
        "step_cpu_ms_p50": {"free": free_cpu, "constrained": constrained_cpu},
        "cpu_overhead_ratio": constrained_cpu / free_cpu,
        "round_ratios": round_ratios,
        "round_ratio_p50": statistics.median(round_ratios),
        "mask_ms_p50": mask_time(engine, prompts, structured),
        "compile": compiles,
    }


def table(result: dict) -> str:
    step, cpu, compile_ = result["step_ms_p50"], result["step_cpu_ms_p50"], result["compile"]
    return "\n".join(
        [
            "| batch 32, decode step | free | 32 schemas | ratio | ratio per round, p50 | masks alone |",
            "|---|---|---|---|---|---|",
            f"| wall p50 ms | {step['free']:.1f} | {step['constrained']:.1f} | {result['overhead_ratio']:.3f} "
            f"| {result['round_ratio_p50']:.3f} | {result['mask_ms_p50']:.2f} |",
            f"| CPU p50 ms | {cpu['free']:.1f} | {cpu['constrained']:.1f} | {result['cpu_overhead_ratio']:.3f} | | |",
            "",
            "| compile per schema | cold p50 | cold max | cached p50 | cached max |",
            "|---|---|---|---|---|",
            f"| ms | {compile_['cold_ms_p50']:.2f} | {compile_['cold_ms_max']:.2f} | "
            f"{compile_['cached_ms_p50']:.4f} | {compile_['cached_ms_max']:.4f} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round of few tokens")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results JSON (a Markdown table beside it)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, tokens = (1, 12) if args.quick else (4, 24)
    load_before = load_average()
    result = {
        "environment": environment(args.threads),
        "quick": args.quick,
        "load_average_before": load_before,
        **run(load_model(), rounds, tokens),
        "load_average_after": load_average(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(table(result) + "\n")
    print(table(result))
    print(f"\nload average before {load_before['uptime']!r}, after {result['load_average_after']['uptime']!r}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
