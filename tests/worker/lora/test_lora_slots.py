"""Rank-class stacks: budget -> slot counts, placement, set / reset, free slots, step metadata."""

import pytest
import torch
from pydantic import ValidationError

from services.worker.lora import AdapterWeights, LoraConfig, ModelShapes
from services.worker.lora.metadata import LoraMetadata
from services.worker.lora.slots import SlotPool
from shared.errors import IntegrityError, NoFreeSlot
from tests.helpers.adapters import tiny_llama_config

SHAPES = ModelShapes.from_hf_config(tiny_llama_config())
# Per layer and rank unit: q 64+64, k 64+32, v 64+32, o 64+64, gate 64+128, up 64+128, down 128+64.
PER_RANK_ALL = 2 * (128 + 96 + 96 + 128 + 192 + 192 + 192)


def random_weights(rank: int, modules: tuple[str, ...] = ("q_proj", "v_proj"), scale: float = 2.0) -> AdapterWeights:
    a = {(layer, m): torch.randn(SHAPES.dims[m][0], rank) for layer in range(2) for m in modules}
    b = {(layer, m): torch.randn(rank, SHAPES.dims[m][1]) for layer in range(2) for m in modules}
    return AdapterWeights(rank=rank, scale=scale, a=a, b=b)


def pool(**config: object) -> SlotPool:
    config.setdefault("memory_budget_bytes", 2**24)
    return SlotPool(LoraConfig(**config), SHAPES, "cpu", torch.float32)


def test_budget_sets_slots_per_rank_class() -> None:
    assert SHAPES.params_per_rank(LoraConfig().target_modules) == PER_RANK_ALL
    budget = 4 * 64 * PER_RANK_ALL * 4 * 3  # 3 rank-64 slots per class's equal share, fp32
    p = pool(memory_budget_bytes=budget)
    assert [c.num_slots for c in p.classes] == [24, 12, 6, 3]
    assert [c.first_slot for c in p.classes] == [0, 24, 36, 42] and p.num_slots == 45
    assert p.slot_bytes == tuple(r * PER_RANK_ALL * 4 for r in (8, 16, 32, 64))
    assert sum(c.a[0]["q_proj"].numel() + c.b[0]["q_proj"].numel() for c in p.classes) > 0
    shared = pool(memory_budget_bytes=budget, class_shares=(2, 1, 0.5, 0.5))
    assert [c.num_slots for c in shared.classes] == [48, 12, 3, 1]
    capped = pool(memory_budget_bytes=budget, max_slots_per_class=5)
    assert [c.num_slots for c in capped.classes] == [5, 5, 5, 3]


def test_q_v_only_pool_holds_q_v_tensors_only() -> None:
    p = pool(memory_budget_bytes=2**22, target_modules=("v_proj", "q_proj"))
    assert set(p.classes[0].a[1]) == {"q_proj", "v_proj"}
    assert p.slot_bytes[0] == 8 * 2 * (128 + 96) * 4


def test_too_small_a_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="less than one slot"):
        pool(memory_budget_bytes=2**16)


@pytest.mark.parametrize(
    "config",
    [{"rank_classes": (16, 8)}, {"rank_classes": (8, 8)}, {"rank_classes": ()}, {"class_shares": (1, 1)},
     {"memory_budget_bytes": 10}, {"target_modules": ("q_proj", "lm_head")}, {"unknown": 1}],
)  # fmt: skip
def test_config_is_bounded(config: dict) -> None:
    with pytest.raises(ValidationError):
        LoraConfig(**config)


def test_config_is_frozen() -> None:
    with pytest.raises(ValidationError):
        LoraConfig().max_num_tokens = 4  # type: ignore[misc]


@pytest.mark.parametrize(("rank", "class_rank"), [(1, 8), (8, 8), (12, 16), (16, 16), (33, 64), (64, 64)])
def test_an_adapter_goes_to_the_smallest_rank_class_that_fits(rank: int, class_rank: int) -> None:
    p = pool()
    slot = p.allocate(rank)
    stack, row = p.locate(slot)
    assert stack.rank == class_rank and row == 0


def test_a_rank_above_the_largest_class_is_refused() -> None:
    with pytest.raises(IntegrityError, match="above the admitted maximum 64"):
        pool().allocate(65)


def test_set_slot_copies_zero_padded_and_reset_slot_zeroes() -> None:
    p = pool()
    weights = random_weights(12, scale=0.5)
    slot = p.allocate(12)
    p.set_slot(slot, weights)
    stack, row = p.locate(slot)
    a, b = stack.a[1]["v_proj"][row], stack.b[1]["v_proj"][row]
    assert a.shape == (64, 16) and b.shape == (16, 32)
    assert torch.equal(a[:, :12], weights.a[(1, "v_proj")]) and not a[:, 12:].any()
    assert torch.equal(b[:12], weights.b[(1, "v_proj")]) and not b[12:].any()
    assert not stack.a[0]["k_proj"][row].any()
    assert stack.scale[row] == 0.5 and stack.row_modules[row] == {"q_proj", "v_proj"}
    p.release(slot)
    zeroed = [
        not (stack.a[layer][m][row].any() or stack.b[layer][m][row].any()) for layer in range(2) for m in stack.a[layer]
    ]
    assert all(zeroed)
    assert stack.scale[row] == 0 and stack.row_modules[row] == frozenset()


def test_set_slot_clears_what_the_previous_adapter_left() -> None:
    p = pool()
    slot = p.allocate(8)
    p.set_slot(slot, random_weights(8, ("q_proj", "down_proj")))
    p.set_slot(slot, random_weights(8, ("v_proj",)))
    stack, row = p.locate(slot)
    assert not stack.a[0]["q_proj"][row].any() and not stack.b[1]["down_proj"][row].any()


def test_a_full_class_raises_no_free_slot_until_one_is_released() -> None:
    p = pool(memory_budget_bytes=4 * 64 * PER_RANK_ALL * 4, max_slots_per_class=2)
    taken = [p.allocate(64)]
    assert not p.can_allocate(64) and p.can_allocate(8)
    with pytest.raises(NoFreeSlot, match="rank class 64") as err:
        p.allocate(64)
    assert err.value.status == 503
    p.release(taken[0])
    assert p.allocate(64) == taken[0]


def test_metadata_groups_tokens_by_rank_class_and_slot() -> None:
    meta = LoraMetadata.allocate(max_tokens=16, class_first_slots=[0, 4, 6, 8], device="cpu")
    slots = torch.tensor([5, 1, 1, -1, 4, 1, 0, 5])  # class 0: slots 0-3, class 1: 4-5, class 2: 6-7
    low, high, unused = meta.fill(slots)
    assert unused is None and low is not None and high is not None
    assert low.token_idx.tolist() == [6, 1, 2, 5] and low.token_row.tolist() == [0, 1, 1, 1]
    assert low.seg_start.tolist() == [0, 1, 4] and low.seg_row.tolist() == [0, 1] and low.max_seg_len == 3
    assert low.segments == ((0, 1, 0, 6), (1, 4, 1, -1))
    assert high.token_idx.tolist() == [4, 0, 7] and high.token_row.tolist() == [0, 1, 1]
    assert high.seg_start.tolist() == [0, 1, 3] and high.seg_row.tolist() == [0, 1]
    assert high.segments == ((0, 1, 0, 4), (1, 3, 1, -1)) and high.max_seg_len == 2
    assert meta.fill(torch.tensor([-1, -1])) == [None, None, None]
    (only_high,) = [i for i in meta.fill(torch.tensor([-1, 7, 7, 6])) if i is not None]
    assert only_high.token_idx.tolist() == [3, 1, 2] and only_high.segments == ((0, 1, 0, 3), (1, 3, 1, 1))
    storage = meta.host_idx.untyped_storage().data_ptr()
    assert low.token_idx.untyped_storage().data_ptr() == storage  # views of the buffers, refilled in place


def test_metadata_refuses_unknown_slots_and_too_many_tokens() -> None:
    meta = LoraMetadata.allocate(max_tokens=4, class_first_slots=[0, 3], device="cpu")
    for slots in ([0, 3], [-2, 0]):
        with pytest.raises(ValueError, match="token slots"):
            meta.fill(torch.tensor(slots))
    with pytest.raises(ValueError, match="exceed"):
        meta.fill(torch.zeros(5, dtype=torch.int64))
