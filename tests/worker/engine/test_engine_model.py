"""The engine's forward pass equals transformers' own logits (fp32), through prefill, decode and mixed steps."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

from services.worker.engine.batch import build_batch
from services.worker.engine.errors import UnsupportedModel
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.linear import CpuLinear, LinearFactory
from services.worker.engine.model import LlamaForward
from services.worker.engine.model_loader import load_model
from services.worker.engine.sequence import EngineRequest, Sequence
from services.worker.engine.weights import load_weights
from tests.helpers.native import needs_toolchain

BLOCK = 4


TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _tiny(config_cls: type, model_cls: type, **kwargs: object) -> PreTrainedModel:
    torch.manual_seed(0)
    return model_cls(config_cls(**TINY, **kwargs)).eval()


def _reference(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _check_against_hf(
    model: PreTrainedModel, prompts: list[list[int]], tokenizer: object, linear: CpuLinear = "torch"
) -> None:
    """Prefill two prompts, decode them while a third prefills in the same step, then decode all."""
    weights = load_weights(model, torch.float32, "cpu", 256)
    forward = LlamaForward(weights, LinearFactory(linear, "cpu", torch.float32))
    cache = KVCache(weights.spec, 64, BLOCK, torch.float32, "cpu")
    blocks = BlockManager(64, BLOCK)
    seqs = [Sequence(EngineRequest(str(i), p), tokenizer) for i, p in enumerate(prompts)]
    running: list[Sequence] = []
    for step, joining in enumerate([seqs[:2], seqs[2:], [], []]):
        for seq in running:
            blocks.append(seq)
        for seq in joining:
            blocks.allocate(seq)
        batch = build_batch(running, joining, BLOCK, "cpu")
        logits = forward.forward(batch.input_ids, batch.positions, batch.meta, cache, batch.logits_indices)
        for row, seq in enumerate(batch.seqs):
            expected = _reference(model, seq.token_ids)
            torch.testing.assert_close(logits[row], expected, atol=2e-4, rtol=1e-4, msg=f"step {step} seq {row}")
            seq.num_cached = seq.num_tokens
            seq.token_ids.append(int(logits[row].argmax()))
        running = batch.seqs


PROMPTS = [[5, 17, 42, 99, 3, 8, 250, 11, 7], [400, 2, 9], [33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 1]]


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: _tiny(LlamaConfig, LlamaForCausalLM, num_attention_heads=4), id="llama-mha"),
        pytest.param(
            lambda: _tiny(
                LlamaConfig, LlamaForCausalLM, num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE
            ),
            id="llama-gqa-llama3-rope",
        ),
        pytest.param(
            lambda: _tiny(
                LlamaConfig,
                LlamaForCausalLM,
                num_attention_heads=4,
                rope_scaling={"type": "linear", "factor": 2.0},
                attention_bias=True,
                mlp_bias=True,
                tie_word_embeddings=False,
            ),
            id="llama-linear-rope-bias-untied",
        ),
        pytest.param(
            lambda: _tiny(Qwen2Config, Qwen2ForCausalLM, num_attention_heads=4, num_key_value_heads=2),
            id="qwen2-qkv-bias",
        ),
    ],
)
@pytest.mark.parametrize("linear", ["torch", "onednn", pytest.param("panel", marks=needs_toolchain)])
def test_tiny_models_match_transformers(model: object, linear: CpuLinear) -> None:
    _check_against_hf(model(), PROMPTS, tokenizer=None, linear=linear)


def test_smollm2_matches_transformers() -> None:
    loaded = load_model()
    texts = ["Hi", "What is the capital of France?", "Name three colours of the rainbow, briefly."]
    prompts = [
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for text in texts
    ]
    _check_against_hf(loaded.model, prompts, loaded.tokenizer, linear="auto")


def test_unsupported_rope_type_is_refused() -> None:
    model = _tiny(
        LlamaConfig, LlamaForCausalLM, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    )
    with pytest.raises(UnsupportedModel, match="rope type 'yarn'"):
        load_weights(model, torch.float32, "cpu", 64)
