"""Paged attention over the KV cache: batched decode, per-sequence causal prefill."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Step layout: decode tokens first (one per sequence), then each prefill's tokens in order."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each token's K/V
    num_decode: int
    decode_blocks: torch.Tensor  # [num_decode * max_blocks] int64 padded block tables, flattened
    decode_mask: torch.Tensor  # [1, num_decode, 1, max_blocks * block_size] bool, True = attend
    prefill_bounds: list[tuple[int, int]]  # token [start, end) of each prefill


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_cache[0][:, slots] = k.transpose(0, 1), same for v; kv_cache [2, kv_heads, num_slots, head_dim]."""
    kv_cache[0].index_copy_(1, slots, k.transpose(0, 1))
    kv_cache[1].index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of every token; writes ``out`` [num_tokens, heads * head_dim] and returns it.

    q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim], this step's K/V
    (already written to ``kv_cache`` [2, kv_heads, num_slots, head_dim]). Prefills start from an
    empty cache, so they attend to their own fresh K/V; decodes gather their blocks from the cache.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    n = meta.num_decode
    if n:
        # Heads sharing a KV head become that head's query rows: GQA without repeating K/V.
        dq = q[:n].view(n, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)
        length = meta.decode_mask.shape[-1]
        blocks = kv_cache.view(2, kv_heads, -1, block_size, head_dim).index_select(2, meta.decode_blocks)
        dk, dv = blocks.view(2, kv_heads, n, length, head_dim)
        res = F.scaled_dot_product_attention(dq, dk, dv, attn_mask=meta.decode_mask)
        out[:n].view(n, kv_heads, -1, head_dim).copy_(res.transpose(0, 1))
    for start, end in meta.prefill_bounds:
        res = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),
            k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1),
            is_causal=True,
            enable_gqa=kv_heads != heads,
        )
        out[start:end].view(end - start, heads, head_dim).copy_(res.transpose(0, 1))
    return out
