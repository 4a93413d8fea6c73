"""Prefix caching: shared prompt blocks are found, reference-counted, isolated by salt and adapter,
evicted only when needed, unpublished when their step fails, and give the same tokens."""

import pytest
import torch

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.kv_cache import BlockAllocator, BlockManager
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.engine.sequence import Sequence
from shared.schemas import SamplingParams

BS = 4


def seq(tokens: list[int], salt: str | None = None, adapter: str | None = None, rid: str = "r") -> Sequence:
    return Sequence(EngineRequest(rid, tokens, cache_salt=salt, adapter=adapter), tokenizer=None)


PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]


def test_shared_prefix_blocks_are_found_and_reference_counted() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    a = seq([*PREFIX, 1, 2])
    manager.allocate(a)
    assert a.num_cached == 0 and len(a.block_table) == 3
    b = seq([*PREFIX, 3, 4, 5])
    manager.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_cached == 8 and b.num_new_tokens == 3
    assert (manager.queried_tokens, manager.hit_tokens) == (21, 8)
    shared = b.block_table[:2]
    manager.free(a)
    assert manager.allocator.num_free == 16 - 2 - 1  # b still reads the shared two
    manager.free(b)
    assert manager.allocator.num_free == 16 and manager.allocator.num_cached == 2
    c = seq([*PREFIX, 9])
    manager.allocate(c)  # the prefix outlives every sequence that computed or read it
    assert c.block_table[:2] == shared and c.num_cached == 8


def test_the_last_prompt_token_is_always_computed_in_a_block_of_its_own() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    manager.allocate(seq([*PREFIX, 1]))
    same = seq(list(PREFIX))  # its whole prompt is cached, but the last token's logits must be computed
    manager.allocate(same)
    assert same.num_cached == 4 and same.num_new_tokens == 4
    assert len(set(same.block_table)) == 2


@pytest.mark.parametrize(
    ("salt", "adapter", "hit"),
    [
        ("tenant-a", "sql@1", True),
        ("tenant-b", "sql@1", False),
        ("tenant-a", "sql@2", False),
        ("tenant-a", None, False),
        (None, "sql@1", False),
    ],
)
def test_only_the_same_salt_and_adapter_share(salt: str | None, adapter: str | None, hit: bool) -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    manager.allocate(seq([*PREFIX, 1], salt="tenant-a", adapter="sql@1"))
    other = seq([*PREFIX, 1], salt=salt, adapter=adapter)
    manager.allocate(other)
    assert other.num_cached == (8 if hit else 0)


def test_digests_chain_over_every_earlier_token() -> None:
    first, second = seq([1, 2, 3, 4, 5, 6, 7, 8, 9]), seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert first.block_hashes(2, BS)[1] != second.block_hashes(2, BS)[1]  # same tokens 4-7, other history
    assert first.block_hashes(2, BS) == seq([1, 2, 3, 4, 5, 6, 7, 8, 10]).block_hashes(2, BS)


def test_cached_blocks_are_taken_only_when_no_empty_block_is_left_oldest_and_tails_first() -> None:
    allocator = BlockAllocator(6)
    old, new = allocator.allocate(2), allocator.allocate(2)
    for block, digest in zip(old + new, (b"o0", b"o1", b"n0", b"n1"), strict=True):
        assert allocator.publish(block, digest)
    assert not allocator.publish(old[0], b"again") and not allocator.publish(5, b"o0")
    allocator.free(old)
    allocator.free(new)
    assert allocator.num_free == 6 and allocator.num_cached == 4
    assert allocator.allocate(2) == [4, 5]  # the never-cached blocks first
    assert allocator.allocate(1) == [old[1]]  # then the oldest sequence's tail before its head
    assert allocator.lookup(b"o1") is None and allocator.lookup(b"o0") == old[0]
    allocator.share(new[0])  # found again: no longer evictable
    assert allocator.allocate(2) == [old[0], new[1]]
    assert not allocator.can_allocate(1)


def test_decoded_tokens_publish_their_block_once_it_is_full() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS)
    s = seq([1, 2, 3, 4, 5, 6])
    manager.allocate(s)
    assert s.num_registered == 1
    for token in (7, 8):
        s.token_ids.append(token)
        manager.append(s)
    assert s.num_registered == 2
    assert manager.allocator.lookup(s.block_hashes(2, BS)[1]) == s.block_table[1]


def test_a_failed_step_unpublishes_what_it_was_to_write() -> None:
    manager = BlockManager(num_blocks=8, block_size=BS)
    kept = seq([*PREFIX, 1], rid="kept")
    manager.allocate(kept)
    manager.commit()
    failed = seq([21, 22, 23, 24, 25, 26, 27, 28, 29], rid="failed")
    manager.allocate(failed)
    manager.rollback()
    assert manager.allocator.lookup(failed.block_hashes(1, BS)[0]) is None
    assert manager.allocator.lookup(kept.block_hashes(1, BS)[0]) == kept.block_table[0]
    manager.free(failed)
    manager.free(kept)
    assert manager.allocator.num_free == 8 and manager.allocator.num_cached == 2


def test_admission_counts_the_idle_cached_blocks_it_would_share() -> None:
    manager = BlockManager(num_blocks=4, block_size=BS)
    first = seq([*PREFIX, 1])
    manager.allocate(first)
    manager.free(first)  # 4 free, two of them the cached prefix
    fits = seq([*PREFIX, 2, 3, 4, 5])  # 3 blocks: 2 shared + 1 new
    too_big = seq(PREFIX + list(range(30, 42)))  # 5 blocks: 2 shared + 3 new, but sharing leaves 2 free
    assert manager.can_allocate(fits) and not manager.can_allocate(too_big)
    manager.allocate(fits)
    assert manager.allocator.num_free == 1


def test_disabled_prefix_caching_publishes_nothing() -> None:
    manager = BlockManager(num_blocks=16, block_size=BS, prefix_caching=False)
    manager.allocate(seq([*PREFIX, 1]))
    second = seq([*PREFIX, 1])
    manager.allocate(second)
    assert second.num_cached == 0 and manager.allocator.num_cached == 0


# --- the engine on SmolLM2 ---------------------------------------------------------------------------

QUESTIONS = ["Name a colour.", "What is two plus two?", "Say hello in French, then in Spanish, then in German."]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]


def engine_of(loaded: LoadedModel, prefix_caching: bool, dtype: str = "float32") -> LLMEngine:
    return LLMEngine.from_loaded(
        loaded,
        EngineConfig(
            kv_cache_bytes=32 * 2**20,
            kv_block_size=8,
            max_model_len=256,
            max_num_batched_tokens=512,
            dtype=dtype,
            enable_prefix_caching=prefix_caching,
        ),
    )


def generate(engine: LLMEngine, batches: list[list[tuple[str, list[int], str | None]]]) -> dict[str, list[int]]:
    """Each batch is added, then stepped until done; returns greedy tokens per request id."""
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        for rid, ids, salt in batch:
            engine.add_request(
                EngineRequest(
                    rid, ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), cache_salt=salt
                )
            )
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_shared_prefixes_give_the_tokens_of_a_cold_cache(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    """Sharing within one step (identical prompts, n > 1 style), across steps (a repeat after the
    first finished) and within a tenant; another tenant's identical prompt is computed afresh.
    fp32: in bf16 a different split of the same prompt rounds differently (see the logits test)."""
    batches = [
        [("a0", prompts[0], "t1"), ("a1", prompts[0], "t1"), ("b0", prompts[1], "t1"), ("c0", prompts[2], "t2")],
        [("a2", prompts[0], "t1"), ("b1", prompts[1], "t1"), ("c1", prompts[2], "t1"), ("c2", prompts[2], "t2")],
    ]
    cold = generate(engine_of(loaded, False), batches)
    engine = engine_of(loaded, True)
    warm = generate(engine, batches)
    assert warm == cold
    assert cold["a0"] == cold["a1"] == cold["a2"]
    blocks = engine.blocks
    template = 3 * 8  # the chat template's first 24 tokens are three full blocks of 8, shared by every prompt
    assert blocks.hit_tokens >= 2 * 8 * ((len(prompts[0]) - 1) // 8) + template
    assert blocks.queried_tokens == sum(len(ids) for batch in batches for _, ids, _ in batch)
    assert blocks.allocator.num_free == engine.num_blocks


def test_a_reset_cache_computes_everything_again(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    engine = engine_of(loaded, True)
    first = generate(engine, [[("x", prompts[2], None)]])
    engine.reset_prefix_cache()
    assert engine.blocks.allocator.num_cached == 0
    hits = engine.blocks.hit_tokens
    again = generate(engine, [[("y", prompts[2], None)]])
    assert engine.blocks.hit_tokens == hits and again["y"] == first["x"]


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_the_prefix_attention_matches_recomputing_the_whole_prompt(
    loaded: LoadedModel, prompts: list[list[int]], dtype: str, tol: float
) -> None:
    """Last-token logits of a prompt whose prefix comes from the cache equal a cold prefill's."""
    logits = []
    for prefix_caching in (False, True):
        engine = engine_of(loaded, prefix_caching, dtype)
        generate(engine, [[("warm", prompts[1], None)]])
        seen: list[torch.Tensor] = []
        forward = engine.model.forward
        engine.model.forward = lambda *a, seen=seen, forward=forward, **k: seen.append(forward(*a, **k)) or seen[-1]
        generate(engine, [[("probe", [*prompts[1][:-1], prompts[2][-1]], None)]])
        logits.append(seen[0])
    assert engine.blocks.hit_tokens >= 8 * ((len(prompts[1]) - 2) // 8)
    # bf16 carries 8 significant bits: one ulp at the largest logit (0.125 at 16) is the noise floor of
    # a different but equally valid summation order, so its absolute tolerance scales with the logits
    atol = tol * max(1.0, float(logits[0].abs().max()) / 4) if dtype == "bfloat16" else tol
    torch.testing.assert_close(logits[1], logits[0], rtol=tol, atol=atol)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))
