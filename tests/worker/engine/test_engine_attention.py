"""Paged attention against a dense per-sequence reference, with block tables scattered over the cache
(as a long-running worker's allocator leaves them) and decodes of different lengths beside prefills."""

import pytest
import torch

from services.worker.engine.attention import (
    AttentionMetadata,
    AttentionParams,
    block_index,
    gather_blocks,
    paged_attention,
    write_kv,
)
from tests.helpers.native import needs_toolchain

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one sequence's last ``len(q)`` tokens over all its ``len(k)`` tokens."""
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    offset = k.shape[0] - q.shape[0]
    allowed = torch.arange(k.shape[0])[None, :] <= torch.arange(q.shape[0])[:, None] + offset
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def test_gather_blocks_copies_each_heads_blocks_in_table_order():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, KV_HEADS, 32 * BLOCK, HEAD_DIM, generator=g)
    blocks = torch.tensor([17, 3, 29, 3, 0, 11])
    out = torch.empty(2 * KV_HEADS, len(blocks), BLOCK * HEAD_DIM)
    gather_blocks(cache, block_index(blocks, cache, BLOCK), BLOCK, out)
    expected = cache.view(2, KV_HEADS, -1, BLOCK, HEAD_DIM).index_select(2, blocks)
    assert torch.equal(out.view_as(expected), expected)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_toolchain)], ids=["eager", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_on_scattered_blocks_and_prefills_match_dense_attention(dtype: torch.dtype, native: bool):
    params = AttentionParams(HEAD_DIM**-0.5, native=native)
    g = torch.Generator().manual_seed(1)
    num_blocks = 40
    cache = torch.zeros(2, KV_HEADS, num_blocks * BLOCK, HEAD_DIM, dtype=dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()  # scattered, never in order
    decode_lengths, prefill_lengths = [9, 1, 14, 5], [7, 3]
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    tables: list[list[int]] = []
    for n in decode_lengths:  # earlier tokens of each decode, already in the cache
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        write_kv(cache, k[:-1], v[:-1], slots[:-1])  # the last token's K/V comes with this step
        history.append((k, v))
        tables.append(table)
    step_k = torch.cat(
        [k[-1:] for k, _ in history]
        + [torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in prefill_lengths]
    )
    step_v = torch.cat(
        [v[-1:] for _, v in history]
        + [torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for n in prefill_lengths]
    )
    q = torch.randn(step_k.shape[0], HEADS, HEAD_DIM, generator=g).to(dtype)
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, decode_lengths, strict=True)]
    bounds, start = [], len(decode_lengths)
    for n in prefill_lengths:
        table = [free.pop() for _ in range(-(-n // BLOCK))]
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        bounds.append((start, start + n))
        start += n
    max_blocks = max(map(len, tables))
    lengths = torch.tensor(decode_lengths)
    mask = torch.arange(max_blocks * BLOCK)[None, :] < lengths[:, None]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode=len(decode_lengths),
        decode_blocks=torch.tensor([b for t in tables for b in t + [0] * (max_blocks - len(t))]),
        decode_mask=mask.view(1, len(decode_lengths), 1, -1),
        decode_lengths=lengths,
        prefill_bounds=bounds,
    )
    write_kv(cache, step_k, step_v, meta.slot_mapping)
    out = paged_attention(q, step_k, step_v, cache, meta, BLOCK, q.new_empty(q.shape[0], HEADS * HEAD_DIM), params)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for i, (k, v) in enumerate(history):
        torch.testing.assert_close(
            out[i : i + 1].float(), _reference(q[i : i + 1].float(), k.float(), v.float()), **tol
        )
    for a, b in bounds:
        torch.testing.assert_close(
            out[a:b].float(), _reference(q[a:b].float(), step_k[a:b].float(), step_v[a:b].float()), **tol
        )
    # a second layer of the same step reuses the step's scratch and bias, and agrees again
    again = paged_attention(q, step_k, step_v, cache, meta, BLOCK, q.new_empty(q.shape[0], HEADS * HEAD_DIM), params)
    assert torch.equal(again, out)
