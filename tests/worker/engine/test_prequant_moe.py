"""Pre-quantized mixture-of-experts checkpoints (GPTQ, AWQ, compressed-tensors; qwen3_moe, qwen2_moe,
mixtral, olmoe): each expert's gate, up and down quantized as modules of their own, the router plain,
Qwen2-MoE's shared expert quantized as a dense MLP. The engine's logits equal a transformers forward whose experts and projections hold the
checkpoint's dequantized weights; greedy output and expert LoRA adapters (PEFT's ``target_parameters``
on the fused experts) equal PEFT over that reference; what is not served is refused in one line."""

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from bench.prequant_writer import write_awq, write_compressed_tensors, write_gptq
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import MODULES, AdapterManager, LoraConfig, ModelShapes
from shared.schemas import SamplingParams
from tests.helpers.adapters import assert_greedy_matches_peft
from tests.helpers.families import PREQUANT_MOE_FAMILIES, PROMPTS, QWEN2_MOE_DENSE_GATE, save_family
from tests.helpers.prequant import prompt_logits, with_weights

Writer = Callable[[PreTrainedModel, Path], dict[str, torch.Tensor]]
CHECKPOINTS: dict[str, tuple[str, Writer]] = {
    "gptq-sym-qwen3-moe": ("qwen3-moe", lambda m, d: write_gptq(m, d, 32, True)),
    "gptq-asym-qwen2-moe": ("qwen2-moe-shared-expert", lambda m, d: write_gptq(m, d, 32, False)),
    "gptq-v2-asym-mixtral": ("mixtral", lambda m, d: write_gptq(m, d, 32, False, "gptq_v2")),
    "awq-mixtral": ("mixtral", lambda m, d: write_awq(m, d, 32)),
    "awq-qwen3-moe": ("qwen3-moe", lambda m, d: write_awq(m, d, 32)),
    "awq-qwen2-moe": ("qwen2-moe-shared-expert", lambda m, d: write_awq(m, d, 32)),
    "gptq-asym-olmoe": ("olmoe", lambda m, d: write_gptq(m, d, 32, False)),
    "ct-pack-int4-qwen2-moe": (
        "qwen2-moe-shared-expert",
        lambda m, d: write_compressed_tensors(m, d, "pack-quantized", 4, symmetric=False),
    ),
    "ct-int-int8-mixtral": ("mixtral", lambda m, d: write_compressed_tensors(m, d, "int-quantized", 8)),
}
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _checkpoint(case: str, root: Path) -> tuple[PreTrainedModel, PreTrainedModel, Path]:
    """(the unquantized model, the reference on the dequantized weights, the checkpoint's directory)."""
    family, write = CHECKPOINTS[case]
    model = PREQUANT_MOE_FAMILIES[family]()
    weights = write(model, save_family(model, root / case))
    assert any(".experts.5." in name for name in weights)  # every expert quantized
    return model, with_weights(copy.deepcopy(model), weights), root / case


def _engine(loaded: LoadedModel, manager: AdapterManager | None = None, dtype: str = "float32") -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=64, max_num_batched_tokens=512, dtype=dtype)
    return LLMEngine.from_loaded(loaded, config, manager)


def _run(engine: LLMEngine, requests: list[EngineRequest]) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
    return tokens, logprobs


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_logits_match_transformers_on_the_dequantized_experts(case: str, tmp_path: Path) -> None:
    """Every prompt token's logits within 1e-4 of the reference; the experts run their quantized weights
    (the fused plain tensors are never materialised) and the unquantized model's logits differ."""
    model, reference, directory = _checkpoint(case, tmp_path)
    engine = _engine(load_model(str(directory)))
    sparse = [layer.experts for layer in engine.model.w.layers if layer.experts is not None]
    assert sparse
    for experts in sparse:
        assert experts.gate_up.is_meta and experts.down.is_meta and not experts.router.is_meta
        assert experts.gate_up_quant is not None and experts.down_quant is not None
        assert len(experts.gate_up_quant) == experts.gate_up.shape[0]
        assert {q.format for q in experts.gate_up_quant} == {"int8" if "int8" in case else "int4"}
    drift = 0.0
    for i, prompt in enumerate(PROMPTS):
        logits = prompt_logits(engine, prompt)
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
            unquantized = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"prompt {i}")
        drift = max(drift, (logits - unquantized).abs().max().item())
    assert drift > 1e-3


@pytest.mark.parametrize("case", ["awq-mixtral", "gptq-asym-qwen2-moe"])
def test_greedy_equals_the_reference_in_a_mixed_batch(case: str, tmp_path: Path) -> None:
    _, reference, directory = _checkpoint(case, tmp_path)
    engine = _engine(load_model(str(directory)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, _ = _run(engine, [EngineRequest(str(i), p, params) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert tokens[str(i)] == out[0, len(prompt) :].tolist(), f"prompt {i}"


def _expert_adapters(reference: PreTrainedModel, root: Path) -> PeftModel:
    """Two adapters of different ranks on the dequantized reference: attention and every expert's fused
    tensors (target_parameters), the second also Qwen2-MoE's shared expert (gate_proj) where it has one."""
    peft: PeftModel | None = None
    shared = reference.config.model_type == "qwen2_moe"
    for seed, (name, rank, modules) in enumerate(
        [
            ("experts-r8", 8, ["q_proj", "v_proj"]),
            ("experts-r16", 16, ["o_proj", *(QWEN2_MOE_DENSE_GATE if shared else ["k_proj"])]),
        ]
    ):
        torch.manual_seed(seed + 1)
        config = PeftLoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=modules,
            target_parameters=EXPERT_PARAMETERS,
            init_lora_weights=False,
        )
        if peft is None:
            peft = get_peft_model(copy.deepcopy(reference), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
    assert peft is not None
    with torch.no_grad():  # PEFT's random B is small: scaled up so the adapters move greedy tokens
        for param_name, param in peft.named_parameters():
            if "lora_B" in param_name:
                param.mul_(4.0)
    peft.eval()
    peft.save_pretrained(str(root), selected_adapters=["experts-r8", "experts-r16"])
    return peft


@pytest.mark.parametrize("case", ["gptq-asym-qwen2-moe", "awq-mixtral"])
def test_expert_adapters_over_the_quantized_base_equal_peft(case: str, tmp_path: Path) -> None:
    """Expert adapters trained on the unquantized shapes load by logical shape; both adapters and the base
    in one batch equal PEFT over the dequantized reference, token for token and logprob within 1e-4, and
    an adapter's request alone gives its tokens in the batch."""
    _, reference, directory = _checkpoint(case, tmp_path)
    peft = _expert_adapters(reference, tmp_path / "adapters")
    loaded = load_model(str(directory))
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    budget = int(48 * shapes.params_per_rank(MODULES) * 4 * 1.01)
    lora = LoraConfig(rank_classes=(8, 16), class_shares=(1.0, 2.0), memory_budget_bytes=budget, max_num_tokens=512)
    manager = AdapterManager(lora, shapes)
    for name in ("experts-r8", "experts-r16"):
        manager.load_adapter(name, tmp_path / "adapters" / name)
    engine = _engine(loaded, manager)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cases = [(i, name) for i in range(len(PROMPTS)) for name in ("experts-r8", "experts-r16", None)]
    tokens, logprobs = _run(
        engine, [EngineRequest(f"{i}-{n}", PROMPTS[i], params, adapter=n, logprobs=True) for i, n in cases]
    )
    assert_greedy_matches_peft(peft, PROMPTS, cases, tokens, logprobs)
    assert any(tokens[f"{i}-{n}"] != tokens[f"{i}-None"] for i, n in cases if n is not None)
    alone, _ = _run(engine, [EngineRequest("alone", PROMPTS[2], params, adapter="experts-r16")])
    assert alone["alone"] == tokens["2-experts-r16"]


def test_bf16_serves_the_experts_on_the_int4_kernel(tmp_path: Path) -> None:
    """bf16 runs each expert on torch's int4 kernel: the first greedy token's logprob within 1% of the
    logits' range of the fp32 reference."""
    _, reference, directory = _checkpoint("gptq-asym-qwen2-moe", tmp_path)
    engine = _engine(load_model(str(directory), dtype=torch.bfloat16), dtype="bfloat16")
    experts = engine.model.w.layers[1].experts
    assert experts is not None and experts.gate_up_quant is not None and experts.gate_up_quant[0].packed is not None
    params = SamplingParams(max_tokens=1, temperature=0.0)
    tokens, logprobs = _run(engine, [EngineRequest(str(i), p, params, logprobs=True) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        bound = 0.01 * max(1.0, expected.abs().max().item())
        assert abs(logprobs[str(i)][0] - expected[tokens[str(i)][0]].item()) <= bound, f"prompt {i}"


def _edit(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = directory / "model.safetensors"
    state = load_file(path)
    change(state)
    save_file(state, path, metadata={"format": "pt"})


def test_a_quantized_router_is_refused_in_one_line(tmp_path: Path) -> None:
    _, _, directory = _checkpoint("gptq-sym-qwen3-moe", tmp_path)
    expert = "model.layers.1.mlp.experts.0.gate_proj"

    def quantized_router(state: dict[str, torch.Tensor]) -> None:  # the router's weight as if it were quantized
        del state["model.layers.1.mlp.gate.weight"]
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            state[f"model.layers.1.mlp.gate.{suffix}"] = state[f"{expert}.{suffix}"].clone()

    _edit(directory, quantized_router)
    with pytest.raises(UnsupportedQuantization, match=r"quantizes the router model\.layers\.1\.mlp\.gate,") as refused:
        load_model(str(directory))
    assert "\n" not in str(refused.value)


def test_a_layer_with_only_some_experts_quantized_is_refused(tmp_path: Path) -> None:
    """An expert whose projections are missing (or plain) beside quantized ones: refused, not served half-meta."""
    _, _, directory = _checkpoint("awq-mixtral", tmp_path)

    def drop_expert(state: dict[str, torch.Tensor]) -> None:
        for key in [k for k in state if ".layers.1.block_sparse_moe.experts.3.w2." in k]:
            del state[key]

    _edit(directory, drop_expert)
    with pytest.raises(UnsupportedQuantization, match=r"17 of the 18 expert projections are quantized"):
        _engine(load_model(str(directory)))


def test_act_order_is_refused_for_moe_as_for_dense(tmp_path: Path) -> None:
    _, _, directory = _checkpoint("gptq-sym-qwen3-moe", tmp_path)
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["desc_act"] = True
    path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match=r"gptq desc_act=true \(act-order g_idx\)"):
        load_model(str(directory))


@pytest.mark.parametrize("case", ["ct-pack-int4-qwen2-moe", "ct-int-int8-mixtral"])
def test_compressed_tensors_own_decompression_reads_every_expert_as_the_engine(case: str, tmp_path: Path) -> None:
    """Where compressed-tensors is importable (not in the project's environment: see docs/models.md): its
    compressor for the checkpoint's format decompresses every expert (and dense) module of the writer's
    MoE checkpoint into the writer's weights and the engine's, and its config matches the routers as ignored."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    from services.worker.engine.model_loader import memory_name

    family, write = CHECKPOINTS[case]
    model = PREQUANT_MOE_FAMILIES[family]()
    weights = write(model, save_family(model, tmp_path / case))
    raw = json.loads((tmp_path / case / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.load_from_registry(raw["format"])
    state = load_file(tmp_path / case / "model.safetensors")
    loaded = load_model(str(tmp_path / case))
    assert len(loaded.packed) == len(weights)
    for name, weight in weights.items():
        local = {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(f"{name}.")}
        theirs = compressor.decompress(local, scheme)["weight"].float()
        torch.testing.assert_close(theirs, weight, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(
            loaded.packed[memory_name(f"{name}.weight")[: -len(".weight")]].dequantize(),
            theirs,
            rtol=0,
            atol=0,
            msg=name,
        )
    routers = [k[: -len(".weight")] for k in state if k.endswith((".gate.weight", "shared_expert_gate.weight"))]
    assert routers and all(any(match_name(r, pattern) for pattern in config.ignore or []) for r in routers)
    assert not any(match_name(name, pattern) for name in weights for pattern in config.ignore or [])
