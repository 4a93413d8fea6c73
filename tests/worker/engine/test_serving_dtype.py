"""bf16 serving: the model is read from disk straight into the serving dtype, the engine holds it
once (its fused weights are the transformers modules' storage), and its logits stay as close to
the fp32 result as transformers' own bf16 forward does.

Documented bf16 tolerance (docs/models.md, "Serving dtype"): on every prompt token,
``|engine_bf16 - fp32| <= 2 * |transformers_bf16 - fp32| + 0.01 * max(1, |logit|max)`` (max over the vocabulary),
and ``|engine_bf16 - transformers_bf16| <= 0.03 * max(1, |logit|max)``. Measured on the tiny family
models: the engine's error is 0.5-1.5x transformers' own, both 0.2-2% of the largest logit.
"""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from services.worker.engine.batch import build_batch
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.linear import CpuLinear, LinearFactory
from services.worker.engine.model import LlamaForward
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.sequence import EngineRequest, Sequence
from services.worker.engine.weights import ModelWeights, load_weights
from tests.helpers.families import FAMILIES, MOE_FAMILIES, PROMPTS, save_family
from tests.helpers.native import TOOLCHAIN

BF16 = torch.bfloat16
SERVED = {**FAMILIES, **MOE_FAMILIES}
MAX_LEN = 64
BLOCK = 4


def _storages(model: PreTrainedModel) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _engine_logits(
    weights: ModelWeights, prompt: list[int], linear: CpuLinear = "auto", native_ops: bool = False
) -> torch.Tensor:
    forward = LlamaForward(weights, LinearFactory(linear, "cpu", BF16), native_layer_ops=native_ops)
    cache = KVCache(weights.spec, 64, BLOCK, BF16, "cpu")
    seq = Sequence(EngineRequest("0", prompt), None)  # type: ignore[arg-type]
    BlockManager(64, BLOCK).allocate(seq)
    batch = build_batch([], [seq], BLOCK, "cpu")
    indices = torch.arange(batch.input_ids.shape[0])
    return forward.forward(batch.input_ids, batch.positions, batch.meta, cache, indices).float()


def _assert_within_bf16_tolerance(engine: torch.Tensor, hf_bf16: torch.Tensor, fp32: torch.Tensor) -> None:
    scale = max(1.0, float(fp32.abs().max()))
    engine_error = float((engine - fp32).abs().max())
    hf_error = float((hf_bf16 - fp32).abs().max())
    assert engine_error <= 2 * hf_error + 0.01 * scale, (engine_error, hf_error, scale)
    assert float((engine - hf_bf16).abs().max()) <= 0.03 * scale


@pytest.fixture(scope="module", params=list(SERVED))
def family_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    model = SERVED[request.param]()
    return model, save_family(model, tmp_path_factory.mktemp(request.param))


def test_loads_in_the_serving_dtype_and_holds_the_weights_once(family_dir: tuple[PreTrainedModel, Path]) -> None:
    _, directory = family_dir
    loaded = load_model(str(directory), dtype=BF16)
    assert {p.dtype for p in loaded.model.parameters()} == {BF16}  # no fp32 detour
    weights = load_weights(loaded.model, BF16, "cpu", MAX_LEN)
    held = _storages(loaded.model)
    for layer in weights.layers:  # the engine's fused matrices are the modules' storage, not a copy
        experts = (layer.experts.router, layer.experts.gate_up, layer.experts.down) if layer.experts else ()
        for tensor in (layer.qkv, layer.o, layer.gate_up, layer.down, *experts):
            if tensor is None:  # a layer of experts only
                continue
            assert tensor.dtype == BF16
            assert tensor.untyped_storage().data_ptr() in held
    assert weights.embed.untyped_storage().data_ptr() in held
    assert weights.lm_head.untyped_storage().data_ptr() in held


def test_bf16_logits_within_the_documented_tolerance(family_dir: tuple[PreTrainedModel, Path]) -> None:
    fp32_model, directory = family_dir
    weights = load_weights(load_model(str(directory), dtype=BF16).model, BF16, "cpu", MAX_LEN)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=BF16).eval()
    for prompt in PROMPTS:
        with torch.no_grad():
            expected = hf_bf16(torch.tensor([prompt])).logits[0].float()
            truth = fp32_model(torch.tensor([prompt])).logits[0].float()
        for linear in ("auto", "torch"):  # the default (oneDNN-packed bf16, or the native panel kernel) and F.linear
            _assert_within_bf16_tolerance(_engine_logits(weights, prompt, linear), expected, truth)
        if TOOLCHAIN:  # kernels.native's fused layer ops: the same bound (their norms sum in another order)
            _assert_within_bf16_tolerance(_engine_logits(weights, prompt, native_ops=True), expected, truth)


def _engine_decode_logits(
    weights: ModelWeights, prompts: list[list[int]], native_ops: bool = False
) -> list[torch.Tensor]:
    """Each prompt's last-position logits from a batched decode step: every prompt but its last token is
    prefilled first, so the last token goes through the decode attention over the paged cache."""
    forward = LlamaForward(weights, LinearFactory("auto", "cpu", BF16), native_layer_ops=native_ops)
    cache = KVCache(weights.spec, 64, BLOCK, BF16, "cpu")
    blocks = BlockManager(64, BLOCK)
    seqs = [Sequence(EngineRequest(str(i), p[:-1]), None) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
    for seq in seqs:
        blocks.allocate(seq)
    batch = build_batch([], seqs, BLOCK, "cpu")
    forward.forward(batch.input_ids, batch.positions, batch.meta, cache, batch.logits_indices)
    for seq, prompt in zip(seqs, prompts, strict=True):
        seq.num_cached = seq.num_tokens
        seq.token_ids.append(prompt[-1])
        blocks.append(seq)
    batch = build_batch(seqs, [], BLOCK, "cpu")
    logits = forward.forward(batch.input_ids, batch.positions, batch.meta, cache, batch.logits_indices).float()
    return list(logits)


def test_bf16_decode_logits_within_the_documented_tolerance(family_dir: tuple[PreTrainedModel, Path]) -> None:
    """The decode path (paged K/V gather, batched decode attention with fp32 softmax) keeps the bound too."""
    fp32_model, directory = family_dir
    weights = load_weights(load_model(str(directory), dtype=BF16).model, BF16, "cpu", MAX_LEN)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(directory, dtype=BF16).eval()
    eager = _engine_decode_logits(weights, PROMPTS)
    for prompt, got in zip(PROMPTS, eager, strict=True):
        with torch.no_grad():
            expected = hf_bf16(torch.tensor([prompt])).logits[0, -1:].float()
            truth = fp32_model(torch.tensor([prompt])).logits[0, -1:].float()
        _assert_within_bf16_tolerance(got.unsqueeze(0), expected, truth)
    if TOOLCHAIN:  # the fused layer ops through prefill and decode keep it too
        native = _engine_decode_logits(weights, PROMPTS, native_ops=True)
        for prompt, got in zip(PROMPTS, native, strict=True):
            with torch.no_grad():
                expected = hf_bf16(torch.tensor([prompt])).logits[0, -1:].float()
                truth = fp32_model(torch.tensor([prompt])).logits[0, -1:].float()
            _assert_within_bf16_tolerance(got.unsqueeze(0), expected, truth)


def test_a_tolerance_breach_is_caught(family_dir: tuple[PreTrainedModel, Path]) -> None:
    """The bound is not vacuous: a final norm off by 1.3x (a misread norm form) breaks it."""
    fp32_model, directory = family_dir
    loaded = load_model(str(directory), dtype=BF16)
    weights = load_weights(loaded.model, BF16, "cpu", MAX_LEN)
    weights.final_norm.mul_(1.3)
    prompt = PROMPTS[0]
    with torch.no_grad():
        truth = fp32_model(torch.tensor([prompt])).logits[0].float()
        expected = AutoModelForCausalLM.from_pretrained(directory, dtype=BF16).eval()(torch.tensor([prompt])).logits[0]
    with pytest.raises(AssertionError):
        _assert_within_bf16_tolerance(_engine_logits(weights, prompt), expected.float(), truth)


def test_smollm2_bf16_logits_within_the_documented_tolerance(smollm_dir: Path) -> None:
    loaded: LoadedModel = load_model(dtype=BF16)
    weights = load_weights(loaded.model, BF16, "cpu", 512)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=BF16).eval()
    fp32 = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    for text in ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"):
        prompt = loaded.tokenizer(text)["input_ids"]
        with torch.no_grad():
            expected = hf_bf16(torch.tensor([prompt])).logits[0].float()
            truth = fp32(torch.tensor([prompt])).logits[0].float()
        _assert_within_bf16_tolerance(_engine_logits(weights, prompt), expected, truth)
