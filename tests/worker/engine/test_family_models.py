"""Every served family, dense and mixture-of-experts, equals transformers (fp32): teacher-forced logits of every prompt token, greedy
tokens of ``generate``, and a mixed prefill/decode batch equal to each request alone; with the eager
layer ops and with kernels.native's fused ones (norms, residual adds, RoPE and the K/V write)."""

from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, PreTrainedModel

from services.worker.engine import EngineConfig, LLMEngine
from services.worker.engine.batch import build_batch
from services.worker.engine.errors import UnsupportedModel
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.linear import LinearFactory
from services.worker.engine.model import LlamaForward
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.sequence import EngineRequest, Sequence
from services.worker.engine.weights import load_weights
from shared.schemas import SamplingParams
from tests.helpers.families import FAMILIES, MOE_FAMILIES, PROMPTS, save_family, word_tokenizer
from tests.helpers.native import needs_toolchain

BLOCK = 4
MAX_LEN = 64
NEW_TOKENS = 6
SERVED = {**FAMILIES, **MOE_FAMILIES}
LAYER_OPS = pytest.mark.parametrize(
    "native_ops", [False, pytest.param(True, marks=needs_toolchain)], ids=["eager", "native"]
)


class _Runner:
    def __init__(self, model: PreTrainedModel, native_ops: bool = False):
        self.weights = load_weights(model, torch.float32, "cpu", MAX_LEN)
        linear = LinearFactory("torch", "cpu", torch.float32)
        self.forward = LlamaForward(self.weights, linear, native_layer_ops=native_ops)
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


@LAYER_OPS
@pytest.mark.parametrize("family", list(SERVED))
def test_teacher_forced_logits_match_transformers(family: str, native_ops: bool) -> None:
    model = SERVED[family]()
    runner = _Runner(model, native_ops)
    for i, prompt in enumerate(PROMPTS):
        logits = runner.step([], [Sequence(EngineRequest(str(i), prompt), None)], every_token=True)  # type: ignore[arg-type]
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits.log_softmax(-1), expected.log_softmax(-1), atol=1e-4, rtol=0)


@LAYER_OPS
@pytest.mark.parametrize("family", list(SERVED))
def test_greedy_tokens_match_generate_alone_and_mixed(family: str, native_ops: bool) -> None:
    model = SERVED[family]()
    expected = [_hf_greedy(model, p) for p in PROMPTS]
    alone = [_Runner(model, native_ops).greedy([p], [0])[0] for p in PROMPTS]
    mixed = _Runner(model, native_ops).greedy(PROMPTS, [0, 2, 3])
    assert alone == expected
    assert mixed == expected


@pytest.mark.parametrize("family", [f for f in SERVED if "window-" in f and "beyond" not in f])
@LAYER_OPS
def test_prefill_past_a_cached_prefix_matches_transformers(family: str, native_ops: bool) -> None:
    """The second prompt shares the first's leading blocks: its prefill reads them from the prefix cache."""
    model = SERVED[family]()
    runner = _Runner(model, native_ops)
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


@pytest.mark.parametrize(
    "family",
    [
        "gemma3-window-8-local-rope",
        "phi3-fused",
        "qwen3-qk-norm",
        "qwen2-moe-shared-expert-dense-first",
        "olmoe-wide-qk-norm",
    ],
)
def test_saved_model_serves_through_load_model(family: str, tmp_path: Path) -> None:
    """From disk as the worker loads it (AutoModelForCausalLM picks the class), through LLMEngine."""
    model = SERVED[family]()
    save_family(model, tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded.model) is type(model)
    config = EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=MAX_LEN, max_num_batched_tokens=256)
    engine = LLMEngine.from_loaded(loaded, config)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(str(i), prompt, params))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == [_hf_greedy(model, p) for p in PROMPTS]


def test_cuda_graphs_are_refused_for_a_moe_model() -> None:
    """The expert groups are sized on the host every step: a captured graph would replay stale ones.
    (The config refuses cuda_graphs off a cuda device, so it is built unvalidated here: the engine
    refuses before it touches the device.)"""
    model = MOE_FAMILIES["olmoe-wide-qk-norm"]()
    loaded = LoadedModel("moe", model, word_tokenizer(model.config.vocab_size), Path("."))  # type: ignore[arg-type]
    config = EngineConfig(kv_cache_bytes=16 * 2**20, max_model_len=MAX_LEN).model_copy(update={"cuda_graphs": True})
    with pytest.raises(UnsupportedModel, match="cuda_graphs is not supported for a mixture-of-experts model"):
        LLMEngine.from_loaded(loaded, config)
