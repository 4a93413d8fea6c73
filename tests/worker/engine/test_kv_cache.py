"""Block allocator and block tables: verb pairs, growth at block boundaries, capacity from a byte budget."""

import pytest
import torch
from pydantic import ValidationError

from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.kv_cache import BlockAllocator, BlockManager, KVCache, blocks_for_budget
from services.worker.engine.sequence import EngineRequest, Sequence
from services.worker.engine.weights import ModelSpec

SPEC = ModelSpec(
    num_layers=30,
    hidden_size=576,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    rms_norm_eps=1e-5,
    attention_scale=0.125,
)


def test_allocator_never_hands_out_more_than_it_has() -> None:
    allocator = BlockAllocator(4)
    first = allocator.allocate(3)
    assert allocator.can_allocate(1) and not allocator.can_allocate(2)
    with pytest.raises(RuntimeError, match="exhausted"):
        allocator.allocate(2)
    allocator.free(first)
    assert allocator.num_free == 4
    assert len(set(allocator.allocate(4))) == 4


def test_freed_blocks_are_reused_first_in_their_order_so_the_used_set_stays_small() -> None:
    allocator = BlockAllocator(64)
    assert allocator.allocate(3) == [0, 1, 2]
    second = allocator.allocate(2)
    assert second == [3, 4]
    allocator.free([0, 1, 2])
    assert allocator.allocate(3) == [0, 1, 2]  # a finished sequence's blocks, in its table's order
    touched: set[int] = set()
    held: list[list[int]] = []
    for i in range(500):  # churn of sequences of 1-4 blocks, at most 3 at once
        if len(held) == 3:
            allocator.free(held.pop(i % 3))
        held.append(allocator.allocate(1 + i % 4))
        touched.update(held[-1])
    assert len(touched) <= 3 + 2 + 3 * 4  # the peak in use (plus the two still held above), not all 64


def test_block_table_grows_only_at_block_boundaries() -> None:
    manager = BlockManager(num_blocks=3, block_size=4)
    seq = Sequence(EngineRequest("r", [1, 2, 3, 4]), tokenizer=None)
    assert manager.can_allocate(seq)
    manager.allocate(seq)
    assert len(seq.block_table) == 1
    seq.token_ids.append(5)
    assert manager.can_append(seq)
    manager.append(seq)
    assert len(seq.block_table) == 2
    for token in (6, 7, 8):
        seq.token_ids.append(token)
        manager.append(seq)
    assert len(seq.block_table) == 2
    manager.free(seq)
    assert seq.block_table == [] and manager.allocator.num_free == 3


def test_capacity_from_byte_budget() -> None:
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, every layer, fp32
    assert SPEC.kv_bytes_per_token(torch.float32) == per_token
    assert blocks_for_budget(SPEC, 16, torch.float32, 100 * 16 * per_token + 5) == 100
    assert blocks_for_budget(SPEC, 16, torch.bfloat16, 100 * 16 * per_token) == 200
    cache = KVCache(SPEC, 10, 16, torch.float32, "cpu")
    assert cache.nbytes == 10 * 16 * per_token
    assert cache.layer(29).shape == (2, 3, 160, 64)


def test_engine_config_is_validated_and_frozen() -> None:
    config = EngineConfig(max_model_len=512, max_num_batched_tokens=512)
    with pytest.raises(ValidationError):
        config.max_num_seqs = 3
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        EngineConfig(max_model_len=4096, max_num_batched_tokens=2048)
    with pytest.raises(ValidationError):
        EngineConfig(dtype="int8")
