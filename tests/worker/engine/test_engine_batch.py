"""build_batch: the step's integers travel to the device as one buffer, every field a view of it, and
the decode mask is derived from the lengths."""

import torch

from services.worker.engine.batch import build_batch
from services.worker.engine.sequence import EngineRequest, Sequence

BLOCK = 4


def _seq(name: str, prompt: list[int], table: list[int], cached: int = 0, slot: int = -1) -> Sequence:
    seq = Sequence(EngineRequest(name, prompt), tokenizer=None)  # type: ignore[arg-type]
    seq.block_table = table
    seq.num_cached = cached
    seq.slot = slot
    return seq


def test_fields_are_views_of_one_buffer_and_the_mask_follows_the_lengths() -> None:
    decodes = [_seq("a", [1, 2, 3, 4, 5], [7, 2]), _seq("b", [6, 7], [4], slot=3)]
    prefills = [_seq("c", [8, 9, 10], [5])]
    batch = build_batch(decodes, prefills, BLOCK, "cpu")
    assert batch.input_ids.tolist() == [5, 7, 8, 9, 10]
    assert batch.positions.tolist() == [4, 1, 0, 1, 2]
    assert batch.meta.slot_mapping.tolist() == [2 * BLOCK + 0, 4 * BLOCK + 1, 20, 21, 22]
    assert batch.logits_indices.tolist() == [0, 1, 4]
    assert batch.meta.decode_blocks.tolist() == [7, 2, 4, 0]
    expected = torch.arange(2 * BLOCK).unsqueeze(0) < torch.tensor([[5], [2]])
    assert torch.equal(batch.meta.decode_mask, expected.view(1, 2, 1, 2 * BLOCK))
    assert batch.token_slots.tolist() == [-1, 3, -1, -1, -1] and batch.has_adapters
    storage = batch.input_ids.untyped_storage().data_ptr()
    for field in (batch.positions, batch.logits_indices, batch.meta.slot_mapping, batch.meta.decode_blocks):
        assert field.untyped_storage().data_ptr() == storage


def test_a_prefill_only_step_has_an_empty_decode_mask_and_no_adapters() -> None:
    batch = build_batch([], [_seq("c", [8, 9, 10], [5])], BLOCK, "cpu")
    assert batch.meta.num_decode == 0 and batch.meta.decode_mask.shape == (1, 0, 1, 0)
    assert not batch.has_adapters
