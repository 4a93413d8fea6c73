"""Where a decode step of the built-in engine spends its time, part by part (#24).

``python -m bench.engine_step [--quick] [--batches 1 32] [--rounds N] [--threads N] [--layer-loop python]``:
for each batch size, bench.engine's chat prompts are prefilled, then each decode step is timed whole
and by part. With the engine's default native layer loop (engine/layer_loop.py) a decode step's
layers are one part, "decoder layers (native loop)"; ``--layer-loop python`` runs them in Python,
each projection and layer op its own part.
The engine's stage functions (projections, RMSNorm, RoPE, the attention's KV write, block gather and
matmuls, the MLP activation, batch building, sampling, detokenisation, scheduling) are wrapped in
perf_counter timers for the run, each part counting its own time only (a part called inside another is
taken out of it), so the parts add up to the step: the two "rest" rows are what no wrapped stage
covers (the embedding, residual adds, the eager activation, views and the Python between them). A
figure is ms per decode step in the median round, min and max beside it. The timers cost about 1 us a
call, some 0.3 ms of a batch-1 step.
"""

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import torch

import kernels.native as native
import services.worker.engine.attention as attention
import services.worker.engine.engine as engine_module
import services.worker.engine.model as model_module
from bench.engine import chat_prompts
from bench.environment import environment, rounds_argument, threads_argument
from bench.roofline import LimitsProbe, roofline, roofline_line, step_floor_ms, weights_of
from bench.rounds import QUICK_ROUNDS, Spread
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.batch_scheduler import BatchScheduler
from services.worker.engine.detokenizer import IncrementalDetokenizer
from services.worker.engine.layer_loop import NativeLayerLoop
from services.worker.engine.linear import Linear
from services.worker.engine.model_loader import load_model
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "engine_step.json"
STEP = "step: rest (outputs, metrics, Python)"
FORWARD = "forward: rest (embedding, residuals, activation, views)"


class BatchRow(TypedDict):
    batch: int
    decode_steps: int
    step_ms: Spread
    step_floor_ms: float
    parts_ms: dict[str, Spread]  # label -> ms per decode step


class StageClock:
    """Exclusive wall time per label of the wrapped functions, while installed."""

    def __init__(self) -> None:
        self.ms: defaultdict[str, float] = defaultdict(float)
        self._children: list[float] = []  # time spent in wrapped callees, one entry per open call
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str | Callable[..., str]) -> None:
        """Time ``owner.name`` under ``label`` (or ``label(*args)``) until ``remove``."""
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._children.pop()
                self.ms[label if isinstance(label, str) else label(*args)] += (elapsed - inner) * 1000
                if self._children:
                    self._children[-1] += elapsed

        self._undo.append((owner, name, real))
        setattr(owner, name, timed)

    def remove(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)
        self._undo.clear()


def install(clock: StageClock, vocab_size: int) -> None:
    """Wrap the engine's stages; before the engine is built (its norm is bound at construction)."""
    forward = model_module.LlamaForward
    clock.wrap(engine_module.LLMEngine, "step", STEP)
    clock.wrap(engine_module.LLMEngine, "_run", FORWARD)
    clock.wrap(BatchScheduler, "schedule", "schedule")
    clock.wrap(engine_module, "build_batch", "build batch (metadata tensors)")
    clock.wrap(engine_module, "sample", "sampling")
    clock.wrap(engine_module.LLMEngine, "_postprocess", "postprocess (finish checks, outputs)")
    clock.wrap(IncrementalDetokenizer, "update", "detokenise")
    clock.wrap(
        Linear,
        "__call__",
        lambda linear, x: "lm_head" if linear.weight.shape[0] == vocab_size else "projections (qkv, o, gate_up, down)",
    )
    clock.wrap(forward, "_norm_plain", "RMSNorm")
    clock.wrap(forward, "_norm_fp32", "RMSNorm")
    clock.wrap(model_module, "apply_rope", "RoPE")
    clock.wrap(model_module, "write_kv", "attention: KV write")
    # kernels.native's fused layer ops (cpu_layer_ops), called through the module's attributes
    clock.wrap(native, "rms_norm", "RMSNorm")
    clock.wrap(native, "add_rms_norm", "residual add + RMSNorm (native)")
    clock.wrap(native, "rope_write_kv", "RoPE + KV write (native)")
    clock.wrap(native, "act_mul", "MLP activation (native)")
    clock.wrap(model_module, "paged_attention", "attention: rest (views, masks, output copy)")
    clock.wrap(attention, "gather_blocks", "attention: gather K/V blocks")
    clock.wrap(attention, "_decode_attention", "attention: decode matmuls, softmax")
    clock.wrap(attention, "paged_decode", "attention: native paged decode (kernels/native.py)")
    clock.wrap(NativeLayerLoop, "__call__", "decoder layers (native loop: projections, attention, layer ops)")


def spread(values: list[float]) -> Spread:
    ordered = sorted(values)
    return {"min": ordered[0], "median": ordered[len(ordered) // 2], "max": ordered[-1]}


def decode_round(engine: LLMEngine, clock: StageClock, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Prefill ``prompts`` (untimed), then ``steps`` decode steps: their mean ms (the parts' ms in ``clock``)."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
    engine.step()
    clock.ms.clear()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return (time.perf_counter() - start) * 1000 / steps


def profile(
    engine: LLMEngine, clock: StageClock, prompts: list[list[int]], steps: int, rounds: int, probe: LimitsProbe
) -> tuple[list[float], dict[str, list[float]]]:
    """Each round's ms per decode step, whole and per part; the machine's limits probed after each round."""
    decode_round(engine, clock, prompts, 2, "warm")
    totals: list[float] = []
    parts: dict[str, list[float]] = {}
    for turn in range(rounds):
        totals.append(decode_round(engine, clock, prompts, steps, f"r{turn}"))
        for label, ms in clock.ms.items():
            parts.setdefault(label, []).append(ms / steps)
        probe.sample()
    return totals, parts


def table(rows: list[BatchRow]) -> str:
    labels = sorted(
        {label for row in rows for label in row["parts_ms"]},
        key=lambda label: -max(row["parts_ms"][label]["median"] for row in rows if label in row["parts_ms"]),
    )
    head = "| part | " + " | ".join(f"batch {row['batch']} ms (min-max)" for row in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]

    def cell(s: Spread | None) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})" if s else "-"

    lines.append("| **decode step** | " + " | ".join(cell(row["step_ms"]) for row in rows) + " |")
    lines += [f"| {label} | " + " | ".join(cell(row["parts_ms"].get(label)) for row in rows) + " |" for label in labels]
    lines.append(
        "| step / floor | "
        + " | ".join(f"{row['step_ms']['median'] / row['step_floor_ms']:.1f}x" for row in rows)
        + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batches 1 and 32, 8 decode steps, finishes in a minute")
    parser.add_argument("--batches", nargs="+", type=int, help="batch sizes (default 1 8 32; 1 32 with --quick)")
    parser.add_argument("--steps", type=int, help="decode steps per round (default 32; 8 with --quick)")
    rounds_argument(parser)
    threads_argument(parser)
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="serving dtype of weights and KV cache"
    )
    parser.add_argument(
        "--layer-loop",
        choices=("auto", "python"),
        default="auto",
        help="EngineConfig.cpu_layer_loop: auto (the native loop, one part) or python (every op its own part)",
    )
    parser.add_argument("--out", type=Path, help=f"result file (default {RESULTS}; other dtypes get -<dtype>)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = args.batches or ([1, 32] if args.quick else [1, 8, 32])
    steps = args.steps or (8 if args.quick else 32)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else 5)
    dtype = getattr(torch, args.dtype)
    loaded = load_model(dtype=dtype)
    probe = LimitsProbe(weights_of(loaded.model), dtype, "cpu")
    print(roofline_line(probe.limits(), args.dtype, args.threads, "cpu"), flush=True)
    clock = StageClock()
    install(clock, loaded.model.config.vocab_size)
    try:
        engine = LLMEngine.from_loaded(
            loaded,
            EngineConfig(
                kv_cache_bytes=512 * 2**20,
                max_model_len=512,
                max_num_seqs=64,
                dtype=args.dtype,
                cpu_layer_loop=args.layer_loop,
            ),
        )
        rows: list[BatchRow] = []
        for batch in batches:
            since = probe.mark()
            totals, parts = profile(engine, clock, chat_prompts(loaded, batch), steps, rounds, probe)
            rows.append(
                {
                    "batch": batch,
                    "decode_steps": steps,
                    "step_ms": spread(totals),
                    "step_floor_ms": step_floor_ms(probe.limits(since), batch),
                    "parts_ms": {label: spread(values) for label, values in parts.items()},
                }
            )
    finally:
        clock.remove()
    result = {
        "environment": environment(args.threads, args.dtype),
        "rounds": rounds,
        "layer_loop": args.layer_loop,
        "headline": "median",
        "roofline": roofline(probe.limits()),
        "roofline_probes": probe.spread(),
        "batches": rows,
    }
    out = args.out or (RESULTS if args.dtype == "float32" else RESULTS.with_name(f"engine_step-{args.dtype}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n## decode step by part: median of {rounds} rounds of {steps} steps (min-max)\n")
    print(table(rows))
    print(probe.line())
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
