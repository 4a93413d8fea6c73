"""CUDA graphs of the decode step: the bucketing, the padded static-buffer forward a graph captures
(run here without capture, on the CPU) against the eager step, the flag's validation, and on a GPU
the captured graphs themselves."""

import warnings
from pathlib import Path

import pytest
import torch

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.batch import build_batch
from services.worker.engine.cuda_graph import MAX_GRAPH_BATCH, DecodeGraphs, bucket_for, graph_batch_sizes
from services.worker.engine.sequence import Sequence
from services.worker.engine.weights import ModelWeights, load_weights
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from services.worker.lora.graph import count_bucket, count_buckets
from shared.schemas import SamplingParams
from tests.helpers.adapters import ALL_MODULES, save_peft_adapter
from tests.helpers.families import FAMILIES, NullTokenizer, tiny_llama

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Six greedy requests finishing at different steps: decode steps of 6, 5, 4, 4, 3, then 1 sequences,
# which pad to buckets 8, 8, 4, 4, 4, then 1.
MAX_TOKENS = [2, 3, 5, 6, 6, 9]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18, 19], [20, 21]]


def test_batch_sizes_are_1_2_4_then_multiples_of_8_up_to_max_num_seqs() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    capped = graph_batch_sizes(4096)
    assert capped[-1] == MAX_GRAPH_BATCH and capped[3:] == list(range(8, MAX_GRAPH_BATCH + 1, 8))
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_bucket_for_takes_the_smallest_bucket_that_holds_the_step() -> None:
    sizes = graph_batch_sizes(10)
    assert [bucket_for(n, sizes) for n in range(1, 12)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10, None]
    with pytest.raises(ValueError):
        bucket_for(0, sizes)


def test_count_buckets_are_0_then_powers_of_2_capped_at_the_batch_bucket() -> None:
    assert [count_bucket(n, 8) for n in range(9)] == [0, 1, 2, 4, 4, 8, 8, 8, 8]
    assert [count_bucket(n, 10) for n in range(11)] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 10, 10]
    assert [count_bucket(n, 3) for n in range(4)] == [0, 1, 2, 3]
    assert count_buckets(1) == [0, 1]
    assert count_buckets(10) == [0, 1, 2, 4, 8, 10]
    assert count_buckets(512) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]  # ceil(log2 512) + 2 per class
    with pytest.raises(ValueError):
        count_bucket(9, 8)


def test_cuda_graphs_on_a_cpu_device_are_refused() -> None:
    with pytest.raises(ValueError, match="cuda_graphs needs a cuda device"):
        EngineConfig(cuda_graphs=True)


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return load_weights(tiny_llama(), torch.float32, "cpu", 64)


def _engine(weights: ModelWeights, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {"num_blocks": 32, "kv_block_size": 4, "max_model_len": 64}
    config = EngineConfig(**{**settings, "max_num_batched_tokens": 64, **overrides})
    engine = LLMEngine(weights, tokenizer=NullTokenizer(), config=config, eos_token_ids=set())  # type: ignore[arg-type]
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        engine.add_request(EngineRequest(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    return engine


def _tokens(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


class Beside(DecodeGraphs):
    """The padded static path without capture; each run also takes the eager forward of the same step."""

    def __init__(self, engine: LLMEngine, scratch: int):
        config = engine.config
        sizes = graph_batch_sizes(config.max_num_seqs)
        manager = engine.adapter_manager
        hook = manager.graph_hook(sizes[-1]) if manager is not None else None
        super().__init__(engine.model, engine.cache, scratch, config.max_model_len, sizes, capture=False, lora=hook)
        self.engine = engine
        self.runs: list[tuple[int, float]] = []  # (sequences, max |padded - eager| of their logits)
        self.keys: list[tuple[int, tuple[int, ...]] | None] = []  # each run's graph key

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        assert not self.engine.blocks.allocator.is_referenced(self.scratch_block)
        self.keys.append(self.key(seqs))
        padded = super().run(seqs).clone()
        batch = build_batch(seqs, [], self.cache.block_size, "cpu")  # rewrites the same K/V to the same slots
        manager = self.engine.adapter_manager
        lora = manager.prepare(batch.token_slots) if manager is not None and batch.has_adapters else None
        meta, indices = batch.meta, batch.logits_indices
        eager = self.model.forward(batch.input_ids, batch.positions, meta, self.cache, indices, lora)
        assert padded.shape == eager.shape
        self.runs.append((len(seqs), float((padded - eager).abs().max())))
        return padded


# sliding windows (their decode biases built before the first layer), soft-caps and local RoPE beside Llama's
@pytest.mark.parametrize(
    "family", ["llama", "mistral-window-8", "gemma2-window-8-softcaps", "gemma3-window-8-local-rope"]
)
def test_the_padded_static_decode_gives_the_eager_steps_logits_and_tokens(family: str) -> None:
    model = tiny_llama() if family == "llama" else FAMILIES[family]()
    weights = load_weights(model, torch.float32, "cpu", 64)
    eager = _engine(weights)
    expected = _tokens(eager)
    graphed = _engine(weights)
    scratch = graphed.num_blocks - 1  # the allocator hands out the low blocks first: this one stays free
    graphed.graphs = beside = Beside(graphed, scratch)
    assert _tokens(graphed) == expected
    assert [n for n, _ in beside.runs] == [6, 5, 4, 4, 3, 1, 1, 1]
    assert max(diff for _, diff in beside.runs) < 1e-4
    cache = graphed.cache
    scratch_slots = cache.data[:, :, :, scratch * cache.block_size : (scratch + 1) * cache.block_size]
    if not family.startswith("gemma"):  # Gemma embeds token 0, its padding id, as zeros
        assert bool(scratch_slots[:, :, :, 0].abs().sum() > 0)  # the padding rows wrote their K/V there
    assert float(scratch_slots[:, :, :, 1:].abs().sum()) == 0.0  # and to its first slot only


def test_with_the_flag_off_there_are_no_graphs_and_no_scratch_block(weights: ModelWeights) -> None:
    engine = _engine(weights)
    assert engine.graphs is None
    assert engine.cache.num_blocks == engine.num_blocks == 32


# adapter -> (rank, target modules): two of rank class 8, one of 16
ADAPTERS = {"r8-all": (8, ALL_MODULES), "r8-qv": (8, ("q_proj", "v_proj")), "r16-mlp": (16, ("gate_proj", "down_proj"))}
# each request's adapter (None: the base model), PROMPTS' order
MIX = ["r8-all", None, "r16-mlp", "r8-qv", "r16-mlp", "r8-all"]


def _lora_engine(weights: ModelWeights, root: Path, device: str = "cpu", **overrides: object) -> LLMEngine:
    """_engine's requests, each on its MIX adapter, over a pool of rank classes 8 and 16 holding ADAPTERS."""
    base = tiny_llama()
    shapes = ModelShapes.from_hf_config(base.config)
    per_rank = shapes.params_per_rank(ALL_MODULES) * 4
    pool = LoraConfig(rank_classes=(8, 16), class_shares=(16.0, 16.0), memory_budget_bytes=40 * per_rank)
    manager = AdapterManager(pool, shapes, device=device)
    for seed, (name, (rank, modules)) in enumerate(ADAPTERS.items()):
        directory = root / name
        if not directory.exists():
            save_peft_adapter(directory, base, rank=rank, alpha=3 * rank, target_modules=modules, seed=seed)
        manager.load_adapter(name, directory)
    settings: dict[str, object] = {"num_blocks": 32, "kv_block_size": 4, "max_model_len": 64, "device": device}
    config = EngineConfig(**{**settings, "max_num_batched_tokens": 64, **overrides})
    engine = LLMEngine(weights, NullTokenizer(), config, set(), manager)  # type: ignore[arg-type]
    for i, (prompt, max_tokens, adapter) in enumerate(zip(PROMPTS, MAX_TOKENS, MIX, strict=True)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        engine.add_request(EngineRequest(str(i), prompt, params, adapter=adapter))
    return engine


def test_the_padded_static_decode_with_two_rank_classes_gives_the_eager_steps_logits(
    weights: ModelWeights, tmp_path: Path
) -> None:
    eager = _lora_engine(weights, tmp_path)
    expected = _tokens(eager)
    graphed = _lora_engine(weights, tmp_path)
    assert _tokens(_engine(weights)) != expected  # the adapters change the greedy tokens
    graphed.graphs = beside = Beside(graphed, graphed.num_blocks - 1)
    assert _tokens(graphed) == expected
    assert [n for n, _ in beside.runs] == [6, 5, 4, 4, 3, 1, 1, 1]
    # (batch bucket, (rank-8 rows, rank-16 rows)) as requests 0, 1, 2, then 3 and 4 finish
    keys = [(8, (4, 2)), (8, (2, 2)), (4, (2, 2)), (4, (2, 2)), (4, (2, 1)), (1, (1, 0)), (1, (1, 0)), (1, (1, 0))]
    assert beside.keys == keys
    assert max(diff for _, diff in beside.runs) < 1e-5


def test_fits_takes_adapter_steps_only_with_a_lora_hook(weights: ModelWeights, tmp_path: Path) -> None:
    engine = _lora_engine(weights, tmp_path)
    engine.step()  # the prefills: every sequence now decodes, five of them on an adapter
    seqs = list(engine._seqs.values())
    assert any(seq.slot >= 0 for seq in seqs)
    sizes = graph_batch_sizes(8)
    hook = engine.adapter_manager.graph_hook(8)  # type: ignore[union-attr]
    plain = DecodeGraphs(engine.model, engine.cache, 31, 64, sizes, capture=False)
    with_lora = DecodeGraphs(engine.model, engine.cache, 31, 64, sizes, capture=False, lora=hook)
    assert not plain.fits(seqs) and plain.fits([seq for seq in seqs if seq.slot < 0])
    assert with_lora.fits(seqs) and not with_lora.fits(seqs * 2)


def test_static_lora_rows_sort_by_class_and_slot_then_pad_dead(weights: ModelWeights, tmp_path: Path) -> None:
    manager = _lora_engine(weights, tmp_path).adapter_manager
    assert isinstance(manager, AdapterManager)
    hook = manager.graph_hook(8)
    r8_all, r8_qv, r16 = (manager.slot_of(name) for name in ADAPTERS)
    assert r8_all is not None and r8_qv is not None and r16 is not None and r8_all < r8_qv < r16
    slots = [r16, -1, r8_qv, r8_all, r8_qv]
    key = hook.key(slots, 8)
    assert key == (4, 1)
    hook.stage(slots, key)
    first16 = hook.first_slots[1]
    assert hook.rows[0, :, :4].tolist() == [[3, 2, 4, 0], [r8_all, r8_qv, r8_qv, 0], [1, 1, 1, 0]]
    assert hook.rows[1, :, :1].tolist() == [[0], [r16 - first16], [1]]
    assert hook.ranks == (8, 16)
    with pytest.raises(ValueError, match="count bucket"):
        hook.stage(slots, (2, 1))


def _synced_steps(engine: LLMEngine) -> tuple[dict[str, list[int]], list[int]]:
    """Step to completion under CUDA's sync debug mode: the tokens, and the host syncs of each step."""
    tokens: dict[str, list[int]] = {}
    syncs: list[int] = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_unfinished():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outputs = engine.step()
            syncs.append(sum("synchronizing" in str(w.message) for w in caught))
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return tokens, syncs


@cuda
@pytest.mark.cuda
def test_captured_graphs_give_the_eager_tokens_with_one_host_sync_per_step() -> None:
    on_gpu = load_weights(tiny_llama(), torch.float32, "cuda", 64)
    expected, eager_syncs = _synced_steps(_engine(on_gpu, device="cuda"))
    engine = _engine(on_gpu, device="cuda", cuda_graphs=True)
    assert engine.graphs is not None and sorted(engine.graphs._graphs) == graph_batch_sizes(64)
    assert engine.cache.num_blocks == engine.num_blocks + 1
    tokens, graphed_syncs = _synced_steps(engine)
    assert tokens == expected
    assert eager_syncs == [1] * len(eager_syncs), eager_syncs
    assert graphed_syncs == [1] * len(graphed_syncs), graphed_syncs


@cuda
@pytest.mark.cuda
def test_captured_graphs_with_adapters_give_the_eager_tokens(tmp_path: Path) -> None:
    on_gpu = load_weights(tiny_llama(), torch.float32, "cuda", 64)
    expected = _tokens(_lora_engine(on_gpu, tmp_path, "cuda"))
    engine = _lora_engine(on_gpu, tmp_path, "cuda", cuda_graphs=True)
    assert engine.graphs is not None
    assert sorted(engine.graphs._graphs) == [(size, (0, 0)) for size in graph_batch_sizes(64)]
    assert _tokens(engine) == expected
    captured = set(engine.graphs._graphs) - {(size, (0, 0)) for size in graph_batch_sizes(64)}
    assert captured == {(8, (4, 2)), (8, (2, 2)), (4, (2, 2)), (4, (2, 1)), (1, (1, 0))}  # each mix on first use
