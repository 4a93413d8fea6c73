"""The demo adapters' own eval scores on quantized weights, against the unquantized model's.

``python -m bench.quant_evals [--systems fp32 bf16 int8 int4-g32 ...] [--threads N] [--items N] [--out PATH]``: per
system (the weights' format and the activations' dtype, as ``bench.quant`` names them; int8 and int4
run bf16 activations, as a worker with ``LF_ENGINE__WEIGHTS`` set does), the built-in engine on the
embedded SmolLM2-135M with the three demo adapters (``lorafleet/demo_adapters``, each trained on that
model) answers every item of each adapter's ``eval.jsonl`` the way the registry's release evaluation
asks it: the worker's chat rendering (``PromptIds``), greedy, the set's ``max_tokens``, the answer's
text scored with the item's scorer (``shared.eval_scorers``). All of a system's items run in one
continuous batch. Prints per adapter the mean score of each system beside the set's release threshold,
and how many answers are word for word those of bf16; writes ``bench/results/quant_evals.json``.
"""

import argparse
import json
import time
from pathlib import Path
from typing import Literal

import torch

from bench.environment import environment
from lorafleet.cli.demo_fit import DEMO_ADAPTERS
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from services.worker.prompt_ids import PromptIds
from shared.eval_scorers import scorer
from shared.eval_set import EvalSetSpec, parse_eval_set
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "quant_evals.json"
Dtype = Literal["float32", "bfloat16"]
Weights = Literal["none", "int8", "int4"]
# name -> (activations' dtype, weight format, int4 group size)
SYSTEMS: dict[str, tuple[Dtype, Weights, int]] = {
    "fp32": ("float32", "none", 32),
    "bf16": ("bfloat16", "none", 32),
    "int8": ("bfloat16", "int8", 32),
    "int4-g32": ("bfloat16", "int4", 32),
    "int4-g64": ("bfloat16", "int4", 64),
    "int4-g128": ("bfloat16", "int4", 128),
}
REFERENCE = "bf16"  # the answers the others are compared with word for word


def demo_sets(items: int | None = None) -> dict[str, EvalSetSpec]:
    """Each demo adapter's eval set (its first ``items`` items), by adapter id (its directory's name)."""
    sets = {}
    for directory in sorted(d for d in DEMO_ADAPTERS.iterdir() if d.is_dir()):
        spec = parse_eval_set((directory / "eval.jsonl").read_bytes())
        sets[directory.name] = spec.model_copy(update={"items": spec.items[:items]})
    return sets


def build(loaded: LoadedModel, system: str, adapters: list[str], threads: int) -> LLMEngine:
    dtype, weights, group = SYSTEMS[system]
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    manager = AdapterManager(LoraConfig(), shapes, dtype=getattr(torch, dtype))
    for adapter in adapters:
        manager.load_adapter(adapter, DEMO_ADAPTERS / adapter / "adapter")
    config = EngineConfig(
        dtype=dtype,
        weights=weights,
        weight_group_size=group,  # type: ignore[arg-type]  # one of 32/64/128, from SYSTEMS
        kv_cache_bytes=256 * 2**20,
        max_model_len=1024,
        num_threads=threads,
        compute_nice=0,
    )
    return LLMEngine.from_loaded(loaded, config, manager)


def answers(engine: LLMEngine, prompts: PromptIds, sets: dict[str, EvalSetSpec]) -> dict[str, list[str]]:
    """Every item's answer text, per adapter, all items in one continuous batch."""
    texts: dict[str, list[str]] = {adapter: [""] * len(spec.items) for adapter, spec in sets.items()}
    for adapter, spec in sets.items():
        params = SamplingParams(max_tokens=spec.meta.max_tokens, temperature=0.0)
        for i, item in enumerate(spec.items):
            ids = prompts.encode(item.messages, item.prompt)
            engine.add_request(EngineRequest(f"{adapter}/{i}", ids, params, adapter=adapter))
    while engine.has_unfinished():
        for out in engine.step():
            adapter, index = out.request_id.rsplit("/", 1)
            texts[adapter][int(index)] += out.text
    return texts


def scores(sets: dict[str, EvalSetSpec], texts: dict[str, list[str]]) -> dict[str, float]:
    return {
        adapter: sum(
            scorer(item.scorer)(text, item.expected) for item, text in zip(spec.items, texts[adapter], strict=True)
        )
        / len(spec.items)
        for adapter, spec in sets.items()
    }


def table(result: dict) -> str:
    systems = list(result["scores"])
    lines = [
        "| adapter | items | threshold | " + " | ".join(systems) + " |",
        "|---|---:|---:|" + "---:|" * len(systems),
    ]
    for adapter, spec in result["sets"].items():
        cells = []
        for system in systems:
            same = result["same_as_reference"][system][adapter]
            cells.append(f"{result['scores'][system][adapter]:.2f} ({same}/{spec['items']} as {REFERENCE})")
        lines.append(f"| {adapter} | {spec['items']} | {spec['threshold']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--items", type=int, help="only each set's first N items (a quick run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    systems = list(dict.fromkeys([REFERENCE, *args.systems]))
    sets = demo_sets(args.items)
    models: dict[str, LoadedModel] = {}
    texts: dict[str, dict[str, list[str]]] = {}
    seconds: dict[str, float] = {}
    refused: dict[str, str] = {}
    for system in systems:
        dtype = SYSTEMS[system][0]
        if dtype not in models:
            models[dtype] = load_model(dtype=getattr(torch, dtype))
        loaded = models[dtype]
        try:
            engine = build(loaded, system, list(sets), args.threads)
        except UnsupportedQuantization as e:  # e.g. int4 groups of 128 over SmolLM2's 576 input features
            refused[system] = e.message
            print(f"{system}: refused: {e.message}", flush=True)
            continue
        started = time.perf_counter()
        texts[system] = answers(engine, PromptIds.for_model(loaded.tokenizer, loaded.directory), sets)
        seconds[system] = time.perf_counter() - started
        print(f"{system}: {sum(len(t) for t in texts[system].values())} answers in {seconds[system]:.1f}s", flush=True)
    result = {
        "environment": environment(args.threads, "bfloat16"),
        "threads": args.threads,
        "sets": {
            a: {"items": len(s.items), "threshold": s.meta.threshold, "max_tokens": s.meta.max_tokens}
            for a, s in sets.items()
        },
        "scores": {system: scores(sets, texts[system]) for system in texts},
        "same_as_reference": {
            system: {a: sum(x == y for x, y in zip(texts[system][a], texts[REFERENCE][a], strict=True)) for a in sets}
            for system in texts
        },
        "refused": refused,
        "seconds": seconds,
        "answers": texts,
    }
    print(table(result))
    for system, why in refused.items():
        print(f"{system}: refused ({why})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
