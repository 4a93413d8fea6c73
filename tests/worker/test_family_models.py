"""Every served family equals transformers (fp32): teacher-forced logits of every prompt token, greedy
tokens of ``generate``, and a mixed prefill/decode batch equal to each request alone."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from services.worker.engine.batch import build_batch
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.linear import LinearFactory
from services.worker.engine.model import LlamaForward
from services.worker.engine.sequence import EngineRequest, Sequence
from services.worker.engine.weights import load_weights

BLOCK = 4
MAX_LEN = 64
NEW_TOKENS = 6
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
PROMPTS = [
    [5, 17, 42, 99, 3, 8, 250, 11, 7],
    [200, 2, 9],
    [33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
]


def _tiny(config_cls: type, model_cls: type, **kwargs: object) -> PreTrainedModel:
    torch.manual_seed(0)
    model: PreTrainedModel = model_cls(config_cls(**TINY, **kwargs)).eval()
    with torch.no_grad():  # norms start at 1 (Gemma: at 0); random ones show a misread norm form
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


GEMMA: dict[str, Any] = {
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "sliding_window": 8,
    "final_logit_softcapping": 3.0,
    "initializer_range": 0.1,
}


FAMILIES: dict[str, Callable[[], PreTrainedModel]] = {
    "llama-head-dim": lambda: _tiny(LlamaConfig, LlamaForCausalLM, head_dim=32),
    "mistral-window-beyond-len": lambda: _tiny(MistralConfig, MistralForCausalLM, sliding_window=4096),
    "mistral-window-8": lambda: _tiny(MistralConfig, MistralForCausalLM, sliding_window=8),
    "qwen2-window-8-second-layer": lambda: _tiny(
        Qwen2Config, Qwen2ForCausalLM, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
    "qwen3-window-5": lambda: _tiny(
        Qwen3Config, Qwen3ForCausalLM, use_sliding_window=True, sliding_window=5, max_window_layers=0
    ),
    "qwen3-qk-norm": lambda: _tiny(Qwen3Config, Qwen3ForCausalLM, head_dim=24, attention_bias=True),
    "gemma2-window-8-softcaps": lambda: _tiny(
        Gemma2Config, Gemma2ForCausalLM, **GEMMA, attn_logit_softcapping=2.0, tie_word_embeddings=True
    ),
    "gemma3-window-8-local-rope": lambda: _tiny(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        **GEMMA,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        },
    ),
    "phi3-fused": lambda: _tiny(Phi3Config, Phi3ForCausalLM, pad_token_id=0),
    "phi3-window-8": lambda: _tiny(Phi3Config, Phi3ForCausalLM, pad_token_id=0, sliding_window=8),
    "granite-multipliers": lambda: _tiny(
        GraniteConfig,
        GraniteForCausalLM,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=2.0,
        initializer_range=0.1,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    ),
}


class _Runner:
    def __init__(self, model: PreTrainedModel):
        self.weights = load_weights(model, torch.float32, "cpu", MAX_LEN)
        self.forward = LlamaForward(self.weights, LinearFactory("torch", "cpu", torch.float32))
        self.cache = KVCache(self.weights.spec, 128, BLOCK, torch.float32, "cpu")
        self.blocks = BlockManager(128, BLOCK)

    def step(self, decodes: list[Sequence], prefills: list[Sequence], every_token: bool = False) -> torch.Tensor:
        for seq in decodes:
            self.blocks.append(seq)
        for seq in prefills:
            self.blocks.allocate(seq)
        batch = build_batch(decodes, prefills, BLOCK, "cpu")
        indices = torch.arange(batch.input_ids.shape[0]) if every_token else batch.logits_indices
        logits = self.forward.forward(batch.input_ids, batch.positions, batch.meta, self.cache, indices)
        for seq in batch.seqs:
            seq.num_cached = seq.num_tokens
        return logits

    def greedy(self, prompts: list[list[int]], joins: list[int]) -> list[list[int]]:
        """Greedy NEW_TOKENS per prompt; prompt i joins at step joins[i], so prefills mix with decodes."""
        seqs = [Sequence(EngineRequest(str(i), list(p)), None) for i, p in enumerate(prompts)]  # type: ignore[arg-type]
        active: list[Sequence] = []
        for step in range(max(joins) + NEW_TOKENS):
            decodes = [s for s in active if len(s.token_ids) - s.num_prompt_tokens < NEW_TOKENS]
            joining = [s for i, s in enumerate(seqs) if joins[i] == step]
            logits = self.step(decodes, joining)
            for row, seq in enumerate(decodes + joining):
                seq.token_ids.append(int(logits[row].argmax()))
            active += joining
        return [s.token_ids[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


def _hf_greedy(model: PreTrainedModel, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        out = model.generate(torch.tensor([prompt]), generation_config=config)  # type: ignore[operator]
    tokens = [int(t) for t in out[0, len(prompt) :]]
    assert len(tokens) == NEW_TOKENS
    return tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_teacher_forced_logits_match_transformers(family: str) -> None:
    model = FAMILIES[family]()
    runner = _Runner(model)
    for i, prompt in enumerate(PROMPTS):
        logits = runner.step([], [Sequence(EngineRequest(str(i), prompt), None)], every_token=True)  # type: ignore[arg-type]
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits.log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_match_generate_alone_and_mixed(family: str) -> None:
    model = FAMILIES[family]()
    expected = [_hf_greedy(model, p) for p in PROMPTS]
    alone = [_Runner(model).greedy([p], [0])[0] for p in PROMPTS]
    mixed = _Runner(model).greedy(PROMPTS, [0, 2, 3])
    assert alone == expected
    assert mixed == expected


@pytest.mark.parametrize("family", [f for f in FAMILIES if "window-" in f and "beyond" not in f])
def test_prefill_past_a_cached_prefix_matches_transformers(family: str) -> None:
    """The second prompt shares the first's leading blocks: its prefill reads them from the prefix cache."""
    model = FAMILIES[family]()
    runner = _Runner(model)
    first = Sequence(EngineRequest("0", PROMPTS[2]), None)  # type: ignore[arg-type]
    runner.step([], [first])
    runner.blocks.publish(first)
    runner.blocks.commit()
    prompt = [*PROMPTS[2][:16], 7, 70, 170, 27, 9, 1, 4, 200, 31, 13]
    second = Sequence(EngineRequest("1", prompt), None)  # type: ignore[arg-type]
    logits = runner.step([], [second], every_token=True)
    cached = len(prompt) - logits.shape[0]
    assert cached == 16
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, cached:].float()
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
