"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) in the weight-only kernels: the engine's
logits equal a transformers forward whose projections hold the checkpoint's dequantized weights, greedy
output and LoRA adapters included; every other quantization_config is refused in one line; the shapes
the adapter checks read stay the config's logical ones."""

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from bench.prequant_writer import ct_pack, ct_quantize, write_awq, write_compressed_tensors, write_gptq
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.prequant import checkpoint_quant
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from shared.fingerprint import BaseModelSpec, compute_fingerprint
from shared.schemas import SamplingParams
from tests.helpers.adapters import assert_greedy_matches_peft
from tests.helpers.families import FAMILIES, PROMPTS, save_family
from tests.helpers.prequant import prompt_logits, with_weights

MAX_LEN = 64
Writer = Callable[[PreTrainedModel, Path], dict[str, torch.Tensor]]


def _wide_llama() -> PreTrainedModel:
    """Projections whose inputs take groups of 64 and 128 (hidden 128, intermediate 256)."""
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


# (name, base model, writer): llama and qwen3 (q/k norms, q/k/v biases) in every format
CHECKPOINTS: list[tuple[str, Callable[[], PreTrainedModel], Writer]] = [
    ("gptq-sym-g32-llama", FAMILIES["llama-head-dim"], lambda m, d: write_gptq(m, d, 32, True)),
    ("gptq-asym-g32-qwen3", FAMILIES["qwen3-qk-norm"], lambda m, d: write_gptq(m, d, 32, False)),
    ("gptq-asym-g64-wide", _wide_llama, lambda m, d: write_gptq(m, d, 64, False)),
    ("gptq-sym-g128-wide", _wide_llama, lambda m, d: write_gptq(m, d, 128, True)),
    ("gptq-v2-asym-g32-llama", FAMILIES["llama-head-dim"], lambda m, d: write_gptq(m, d, 32, False, "gptq_v2")),
    ("awq-g32-llama", FAMILIES["llama-head-dim"], lambda m, d: write_awq(m, d, 32)),
    ("awq-g128-wide", _wide_llama, lambda m, d: write_awq(m, d, 128)),
    ("awq-g32-qwen3", FAMILIES["qwen3-qk-norm"], lambda m, d: write_awq(m, d, 32)),
    ("ct-pack-int4-qwen3", FAMILIES["qwen3-qk-norm"], lambda m, d: write_compressed_tensors(m, d, "pack-quantized", 4)),
    (
        "ct-pack-int4-asym-g64-wide",
        _wide_llama,
        lambda m, d: write_compressed_tensors(m, d, "pack-quantized", 4, 64, symmetric=False),
    ),
    (
        "ct-pack-int8-llama",
        FAMILIES["llama-head-dim"],
        lambda m, d: write_compressed_tensors(m, d, "pack-quantized", 8),
    ),
    ("ct-int-int8-qwen3", FAMILIES["qwen3-qk-norm"], lambda m, d: write_compressed_tensors(m, d, "int-quantized", 8)),
    (
        "ct-naive-int4-asym-llama",
        FAMILIES["llama-head-dim"],
        lambda m, d: write_compressed_tensors(m, d, "naive-quantized", 4, symmetric=False),
    ),
]
IDS = [c[0] for c in CHECKPOINTS]


def _checkpoint(case: str, root: Path) -> tuple[PreTrainedModel, PreTrainedModel, Path]:
    """(the unquantized model, the reference on the dequantized weights, the checkpoint's directory)."""
    _, make, write = next(c for c in CHECKPOINTS if c[0] == case)
    model = make()
    weights = write(model, save_family(model, root / case))
    return model, with_weights(copy.deepcopy(model), weights), root / case


def _engine(loaded: LoadedModel, dtype: str = "float32", manager: AdapterManager | None = None) -> LLMEngine:
    config = EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=MAX_LEN, max_num_batched_tokens=512, dtype=dtype)
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


@pytest.mark.parametrize("case", IDS)
def test_logits_match_transformers_on_the_dequantized_weights(case: str, tmp_path: Path) -> None:
    """Every prompt token's logits (prefill) within 1e-4 of the reference; the unquantized model's differ."""
    model, reference, directory = _checkpoint(case, tmp_path)
    loaded = load_model(str(directory))
    engine = _engine(loaded)
    expected_path = "int8" if "int8" in case else "int4"
    assert {linear.path for proj in engine.model.proj for linear in proj.values()} == {expected_path}
    assert engine.model.lm_head.quant is None  # the checkpoint leaves lm_head plain
    drift = 0.0
    for i, prompt in enumerate(PROMPTS):
        logits = prompt_logits(engine, prompt)
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
            unquantized = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4, msg=f"prompt {i}")
        drift = max(drift, (logits - unquantized).abs().max().item())
    assert drift > 1e-3


@pytest.mark.parametrize("case", ["gptq-asym-g32-qwen3", "awq-g128-wide", "ct-pack-int8-llama"])
def test_greedy_equals_the_reference_in_a_mixed_batch(case: str, tmp_path: Path) -> None:
    _, reference, directory = _checkpoint(case, tmp_path)
    engine = _engine(load_model(str(directory)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, _ = _run(engine, [EngineRequest(str(i), p, params) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert tokens[str(i)] == out[0, len(prompt) :].tolist(), f"prompt {i}"


@pytest.mark.parametrize("case", ["gptq-asym-g32-qwen3", "ct-pack-int4-asym-g64-wide"])
def test_bf16_serves_asymmetric_zeros_on_the_int4_kernel(case: str, tmp_path: Path) -> None:
    """bf16 runs torch's int4 kernel with (8 - z) * s as each group's offset: within 1% of the logits'
    range of the fp32 reference (a wrong zero point moves them by far more: see the drift check above)."""
    _, reference, directory = _checkpoint(case, tmp_path)
    engine = _engine(load_model(str(directory), dtype=torch.bfloat16), "bfloat16")
    quant = engine.model.proj[0]["qkv"].quant
    assert quant is not None and quant.packed is not None
    tokens, logprobs = _run(
        engine,
        [
            EngineRequest(str(i), p, SamplingParams(max_tokens=1, temperature=0.0), logprobs=True)
            for i, p in enumerate(PROMPTS)
        ],
    )
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
        got = logprobs[str(i)][0]
        bound = 0.01 * max(1.0, expected.abs().max().item())
        assert abs(got - expected[tokens[str(i)][0]].item()) <= bound, f"prompt {i}"


def test_lora_adapters_match_peft_on_the_dequantized_model(tmp_path: Path) -> None:
    """Adapters trained on the unquantized model's shapes load by logical shape; base and two adapters in
    one batch equal PEFT over the dequantized reference, token for token and logprob within 1e-4."""
    _, reference, directory = _checkpoint("gptq-asym-g32-qwen3", tmp_path)
    peft = None
    for seed, (name, rank, modules) in enumerate(
        [
            ("attn-r8", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
            ("mlp-r16", 16, ["gate_proj", "up_proj", "down_proj"]),
        ]
    ):
        torch.manual_seed(seed)
        config = PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
        if peft is None:
            peft = get_peft_model(copy.deepcopy(reference), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
    assert peft is not None
    peft.eval()
    adapters = tmp_path / "adapters"
    peft.save_pretrained(str(adapters), selected_adapters=["attn-r8", "mlp-r16"])
    loaded = load_model(str(directory))
    shapes = ModelShapes.from_hf_config(loaded.model.config)
    lora = LoraConfig(rank_classes=(8, 16), class_shares=(1.0, 2.0), memory_budget_bytes=64 * 2**20, max_num_tokens=512)
    manager = AdapterManager(lora, shapes)
    for name in ("attn-r8", "mlp-r16"):
        manager.load_adapter(name, adapters / name)
    engine = _engine(loaded, manager=manager)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cases = [(i, name) for i in range(len(PROMPTS)) for name in ("attn-r8", "mlp-r16", None)]
    tokens, logprobs = _run(
        engine, [EngineRequest(f"{i}-{n}", PROMPTS[i], params, adapter=n, logprobs=True) for i, n in cases]
    )
    assert_greedy_matches_peft(peft, PROMPTS, cases, tokens, logprobs)
    assert any(tokens[f"{i}-mlp-r16"] != tokens[f"{i}-None"] for i in range(len(PROMPTS)))


def test_adapter_shapes_and_architecture_stay_logical(tmp_path: Path) -> None:
    """The LoRA shape check (ModelShapes), the registry's adapter check and the fingerprint's architecture
    (BaseModelSpec) and the engine's projections see the unquantized model's shapes, not the packed
    tensors'; the fingerprint hashes the checkpoint's own tensors (another base than the unquantized one)."""
    model, _, directory = _checkpoint("awq-g32-qwen3", tmp_path)
    plain = save_family(model, tmp_path / "plain")
    loaded = load_model(str(directory))
    assert ModelShapes.from_hf_config(loaded.model.config) == ModelShapes.from_hf_config(model.config)
    spec = BaseModelSpec.from_model_dir(directory)
    assert spec == BaseModelSpec.from_model_dir(plain)
    assert spec.projection_dims()["down_proj"] == (96, 64)  # (in, out) of the logical [64, 96] weight
    assert compute_fingerprint(directory) != compute_fingerprint(plain)
    engine = _engine(loaded)
    reference = _engine(load_model(str(plain)))
    for a, b in zip(engine.model.proj, reference.model.proj, strict=True):
        assert {k: v.weight.shape for k, v in a.items()} == {k: v.weight.shape for k, v in b.items()}


REFUSED = {
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "gguf": {"quant_method": "gguf"},
    "exl2": {"quant_method": "exl2", "bits": 4.0},
    "gptq desc_act=true": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
    "gptq bits=8": {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False},
    "gptq group_size=-1": {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False},
    "awq version='gemv'": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
    "compressed-tensors activation quantization": {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "int", "dynamic": True, "strategy": "token"},
            }
        },
    },
    "compressed-tensors format='float-quantized'": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
    },
}


@pytest.mark.parametrize("detail", list(REFUSED))
def test_other_quantization_configs_are_refused_in_one_line(detail: str, tmp_path: Path) -> None:
    directory = save_family(FAMILIES["llama-head-dim"](), tmp_path / "m")
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": REFUSED[detail]}))
    with pytest.raises(UnsupportedQuantization) as refused:
        load_model(str(directory))
    message = str(refused.value)
    assert "\n" not in message and detail.split(" ")[-1].split("=")[0] in message
    assert "served: gptq int4" in message and "awq int4" in message and "compressed-tensors" in message


def test_gptq_g_idx_reordering_is_refused(tmp_path: Path) -> None:
    """desc_act=false with a g_idx that is not arange(in) // group_size would dequantize the wrong groups."""
    from safetensors.torch import load_file, save_file

    _, _, directory = _checkpoint("gptq-sym-g32-llama", tmp_path)
    state = load_file(directory / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.g_idx"
    state[key] = state[key].flip(0).contiguous()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedQuantization, match=r"gptq g_idx reordering \(model.layers.0.self_attn.q_proj\)"):
        load_model(str(directory))


def test_checkpoint_quant_reads_none_for_a_plain_model() -> None:
    assert checkpoint_quant(FAMILIES["llama-head-dim"]().config) is None


@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (4, False), (8, True)])
def test_compressed_tensors_own_packing_and_dequantization_agree(bits: int, symmetric: bool) -> None:
    """Where compressed-tensors is importable (not in the project's environment: see docs/models.md), its
    pack_to_int32 gives this writer's bytes and its dequantize the reader's weights."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    from services.worker.engine.prequant import CheckpointQuant, read_linear

    torch.manual_seed(bits)
    w = torch.randn(48, 128)
    q, scale, zero_point = ct_quantize(w, bits, 32, symmetric)
    assert torch.equal(helpers.pack_to_int32(q, bits), ct_pack(q, bits))
    tensors = {"m.weight_packed": ct_pack(q, bits), "m.weight_shape": torch.tensor([48, 128]), "m.weight_scale": scale}
    if zero_point is not None:
        packed_zp = helpers.pack_to_int32(zero_point, bits, packed_dim=0)
        assert torch.equal(packed_zp, ct_pack(zero_point.T.contiguous(), bits).T)
        tensors["m.weight_zero_point"] = packed_zp
    args = QuantizationArgs(
        num_bits=bits,
        symmetric=symmetric,
        strategy="channel" if bits == 8 else "group",
        group_size=None if bits == 8 else 32,
    )
    expected = dequantize(x_q=q, scale=scale, zero_point=zero_point, args=args).float()
    quant = CheckpointQuant("compressed-tensors", bits, 0 if bits == 8 else 32, symmetric, ct_format="pack-quantized")  # type: ignore[arg-type]
    torch.testing.assert_close(read_linear(quant, tensors, "m").dequantize(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("fmt", "bits", "symmetric", "family"),
    [
        ("pack-quantized", 4, True, "llama-head-dim"),
        ("pack-quantized", 4, False, "qwen3-qk-norm"),
        ("pack-quantized", 8, True, "llama-head-dim"),
        ("int-quantized", 8, True, "qwen3-qk-norm"),
        ("naive-quantized", 8, True, "llama-head-dim"),
    ],
)
def test_checkpoints_written_by_compressed_tensors_match_its_own_decompression(
    fmt: str, bits: int, symmetric: bool, family: str, tmp_path: Path
) -> None:
    """Where compressed-tensors is importable: a checkpoint its ModelCompressor wrote (its config.json as
    llm-compressor saves it) loads into the same weights its own decompression gives, and the logits equal
    transformers over those weights within 1e-4."""
    pytest.importorskip("compressed_tensors")
    from tests.helpers.prequant import write_with_compressed_tensors

    weights = write_with_compressed_tensors(FAMILIES[family](), tmp_path / "ct", fmt, bits, symmetric)
    loaded = load_model(str(tmp_path / "ct"))
    assert sorted(loaded.packed) == sorted(weights)
    for name, weight in weights.items():
        torch.testing.assert_close(loaded.packed[name].dequantize(), weight, rtol=0, atol=0)
    reference = with_weights(FAMILIES[family](), weights)
    engine = _engine(loaded)
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(prompt_logits(engine, prompt), expected, atol=1e-4, rtol=1e-4)
