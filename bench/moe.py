"""Decode TPOT of a mixture-of-experts model against the dense model with equal active parameters.

``python -m bench.moe [--quick] [--rounds N] [--threads N]``: two random Qwen3-shaped models, alike but
for the MLP: the MoE has 8 experts of width 1024 routing each token to 2 (``norm_topk_prob``), the dense
model one MLP of width 2048, so every token runs the same multiply-adds (hidden 1024, 16 heads on 4 KV
heads, 4 layers, vocab 4096). The built-in engine decodes each at batch 1 and 8, the two models
in rotating order within each round; TPOT is the median decode-step time of a round, and each round's
MoE / dense ratio is taken before the median over rounds (min and max beside it). The dense model also
runs with its layers in the Python loop, as the MoE's run (the native layer loop serves dense models only). The MoE reads more expert weights at batch
8 than the dense model reads (the batch's tokens pick up to all 8 experts), so its ratio there is bound
by memory reads, not by arithmetic.

The MoE also decodes with LoRA: every request its own rank-16 adapter on q/k/v/o and on every expert's
gate, up and down (PEFT's ``target_parameters`` form, read by the worker's loader), the batch's adapters
all distinct; ``lora_ratio_vs_base`` is the MoE's base TPOT over its multi-LoRA TPOT in the same round
(1.0: LoRA costs nothing), as bench.multilora's ``tpot_ratio_vs_base``.
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from bench.environment import environment, rounds_argument, threads_argument
from bench.rounds import DEFAULT_ROUNDS, QUICK_ROUNDS, spread
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.layer_loop import CpuLayerLoop
from services.worker.engine.model_loader import LoadedModel
from services.worker.lora import MODULES, AdapterManager, LoraConfig, ModelShapes
from services.worker.lora.peft_loader import to_slot_layout
from shared.schemas import SamplingParams

RESULTS = Path(__file__).parent / "results" / "moe.json"
SHAPE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 1024
BATCHES = (1, 8)
LORA_RANK = 16


class _CharTokenizer:
    """Decodes each id to one CJK character: the engine's detokeniser runs without a vocabulary."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def _models() -> dict[str, PreTrainedModel]:
    torch.manual_seed(0)
    moe_config = Qwen3MoeConfig(
        **SHAPE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=EXPERT_WIDTH,
        intermediate_size=TOP_K * EXPERT_WIDTH,
        norm_topk_prob=True,
    )
    moe = Qwen3MoeForCausalLM(moe_config).eval()
    with torch.no_grad():  # a router at its zero init ties every expert; spread the tokens over them
        for layer in moe.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    dense = Qwen3ForCausalLM(Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH)).eval()
    return {"moe": moe, "dense": dense}


def _expert_adapters(model: PreTrainedModel, count: int) -> AdapterManager:
    """``count`` random rank-16 adapters on attention and every expert (target_parameters form), resident."""
    shapes = ModelShapes.from_hf_config(model.config)
    per_slot = LORA_RANK * shapes.params_per_rank(MODULES) * 4
    config = LoraConfig(rank_classes=(LORA_RANK,), memory_budget_bytes=count * per_slot, max_num_tokens=512)
    manager = AdapterManager(config, shapes)
    h, q, kv, e, inter, r = SHAPE["hidden_size"], 16 * 64, 4 * 64, EXPERTS, EXPERT_WIDTH, LORA_RANK
    generator = torch.Generator().manual_seed(1)
    for n in range(count):
        tensors: dict[str, torch.Tensor] = {}
        for layer in range(SHAPE["num_hidden_layers"]):
            prefix = f"base_model.model.model.layers.{layer}"
            shapes_of = {
                "self_attn.q_proj": ((r, h), (q, r)),
                "self_attn.k_proj": ((r, h), (kv, r)),
                "self_attn.v_proj": ((r, h), (kv, r)),
                "self_attn.o_proj": ((r, q), (h, r)),
                "mlp.experts.base_layer": ((r * e, h), (2 * inter, r * e)),
                "mlp.experts": ((r * e, inter), (h, r * e)),
            }
            for module, (a, b) in shapes_of.items():
                tensors[f"{prefix}.{module}.lora_A.weight"] = torch.randn(a, generator=generator) * 0.02
                tensors[f"{prefix}.{module}.lora_B.weight"] = torch.randn(b, generator=generator) * 0.02
        adapter = {"r": r, "lora_alpha": 2 * r, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
        manager.load_adapter(f"a{n}", to_slot_layout(adapter, tensors, shapes, max_rank=r, allowed_modules=MODULES))
    return manager


def _engine(
    model: PreTrainedModel, layer_loop: CpuLayerLoop = "auto", adapters: AdapterManager | None = None
) -> LLMEngine:
    loaded = LoadedModel("bench", model, _CharTokenizer(), Path("."))  # type: ignore[arg-type]
    config = EngineConfig(
        kv_cache_bytes=64 * 2**20, max_model_len=512, enable_prefix_caching=False, cpu_layer_loop=layer_loop
    )
    return LLMEngine.from_loaded(loaded, config, adapters)


def _tpot_ms(engine: LLMEngine, batch: int, new_tokens: int, round_index: int) -> float:
    """The median decode-step time of ``batch`` requests generating ``new_tokens`` each (each with its
    own adapter where the engine has them)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    lora = engine.adapter_manager is not None
    for i in range(batch):
        prompt = [(7 * i + 13 * j + round_index) % SHAPE["vocab_size"] for j in range(24)]
        engine.add_request(EngineRequest(f"{round_index}-{i}", prompt, params, adapter=f"a{i}" if lora else None))
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return 1e3 * statistics.median(steps)


def run(rounds: int, new_tokens: int) -> dict[str, Any]:
    models = _models()
    engines = {name: _engine(model) for name, model in models.items()}
    # the dense model's layers in the Python loop, as the MoE's run (the native layer loop is dense-only)
    engines["dense_python_loop"] = _engine(models["dense"], "python")
    engines["moe_lora"] = _engine(models["moe"], adapters=_expert_adapters(models["moe"], max(BATCHES)))
    for engine in engines.values():  # warm up: packing, first-touch of the weights
        _tpot_ms(engine, max(BATCHES), 4, -1)
    tpot: dict[int, dict[str, list[float]]] = {b: {name: [] for name in engines} for b in BATCHES}
    for r in range(rounds):
        for batch in BATCHES:
            order = list(engines)[r % len(engines) :] + list(engines)[: r % len(engines)]
            for name in order:
                tpot[batch][name].append(_tpot_ms(engines[name], batch, new_tokens, r))
    rows = []
    for batch in BATCHES:
        moe = tpot[batch]["moe"]
        rows.append(
            {
                "batch": batch,
                "tpot_ms": {name: spread(values) for name, values in tpot[batch].items()},
                "moe_over_dense": spread([m / d for m, d in zip(moe, tpot[batch]["dense"], strict=True)]),
                "moe_over_dense_python_loop": spread(
                    [m / d for m, d in zip(moe, tpot[batch]["dense_python_loop"], strict=True)]
                ),
                "lora_ratio_vs_base": spread([m / lo for m, lo in zip(moe, tpot[batch]["moe_lora"], strict=True)]),
            }
        )
    return {
        "experts": EXPERTS,
        "top_k": TOP_K,
        "expert_width": EXPERT_WIDTH,
        "lora_rank": LORA_RANK,
        "shape": SHAPE,
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| batch | MoE TPOT ms | dense TPOT ms | dense, Python layer loop | MoE / dense | MoE / dense, Python loop "
        "| MoE + expert LoRA TPOT ms | LoRA ratio_vs_base |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        tpot, ratio, loop = row["tpot_ms"], row["moe_over_dense"], row["moe_over_dense_python_loop"]
        lora = row["lora_ratio_vs_base"]
        lines.append(
            f"| {row['batch']} | {tpot['moe']['median']:.2f} | {tpot['dense']['median']:.2f} | "
            f"{tpot['dense_python_loop']['median']:.2f} | {ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}] | "
            f"{loop['median']:.2f}x [{loop['min']:.2f}-{loop['max']:.2f}] | {tpot['moe_lora']['median']:.2f} | "
            f"{lora['median']:.2f} [{lora['min']:.2f}-{lora['max']:.2f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds and tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    rounds_argument(parser)
    threads_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    model = f"random qwen3_moe ({EXPERTS} experts of {EXPERT_WIDTH}, top-{TOP_K}) vs qwen3 (MLP {TOP_K * EXPERT_WIDTH})"
    result = {"environment": {**environment(args.threads), "model": model}, **run(rounds, 8 if args.quick else 32)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
