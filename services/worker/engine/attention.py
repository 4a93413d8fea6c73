"""Paged attention over the KV cache: batched decode, per-sequence causal prefill, optionally
within a sliding window (a token at position i sees positions j with i - window < j <= i)."""

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.native import DTYPES as NATIVE_DTYPES
from kernels.native import MAX_HEAD_DIM as NATIVE_MAX_HEAD_DIM
from kernels.native import native_decode, paged_decode

CpuAttention = Literal["auto", "torch", "native"]


def use_native_decode(mode: CpuAttention, device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decodes take kernels.native's paged kernel: ``auto`` where it applies (CPU, fp32 or bf16,
    head_dim <= 256) and builds and passes its probe here, ``torch`` never, ``native`` always (raises
    ValueError where it cannot)."""
    if mode == "torch":
        return False
    applies = torch.device(device).type == "cpu" and dtype in NATIVE_DTYPES and head_dim <= NATIVE_MAX_HEAD_DIM
    if applies and native_decode():
        return True
    if mode == "native":
        raise ValueError(
            f"cpu_attention='native' is not usable for {device} {dtype} head_dim {head_dim}: the kernel serves CPU "
            f"fp32 and bf16 up to head_dim {NATIVE_MAX_HEAD_DIM}, and needs a C++ toolchain to build (see the log)"
        )
    return False


@dataclass(slots=True)
class AttentionMetadata:
    """Step layout: decode tokens first (one per sequence), then each prefill's tokens in order."""

    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each token's K/V
    num_decode: int
    decode_blocks: torch.Tensor  # [num_decode * max_blocks] int64 padded block tables, flattened
    decode_mask: torch.Tensor  # [1, num_decode, 1, max_blocks * block_size] bool, True = attend
    decode_lengths: torch.Tensor  # [num_decode] int64 context length of each decode, its new token included
    prefill_bounds: list[tuple[int, int]]  # token [start, end) of each prefill's new tokens
    # Per prefill: None when it starts from an empty cache, else (cache slots of its whole context,
    # fp32 causal bias [new tokens, context]) for one that continues a shared cached prefix.
    prefill_contexts: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    # Built on first use by the first layer, reused by the others (same step, same shapes).
    _decode_bias: torch.Tensor | None = field(default=None, repr=False)
    _decode_index: torch.Tensor | None = field(default=None, repr=False)
    _decode_kv: torch.Tensor | None = field(default=None, repr=False)
    # Sliding-window variants, built on first use per window (layers sharing a window share them).
    _windowed: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as an additive bias (0 = attend, -inf = not): SDPA's CPU kernel runs a third faster
        with it than with a boolean mask."""
        if self._decode_bias is None or self._decode_bias.dtype != dtype:
            bias = torch.zeros(self.decode_mask.shape, dtype=dtype, device=self.decode_mask.device)
            self._decode_bias = bias.masked_fill_(~self.decode_mask, float("-inf"))
        return self._decode_bias

    def window_decode_bias(self, dtype: torch.dtype, window: int) -> torch.Tensor:
        """decode_bias that also hides the cache positions more than ``window - 1`` behind each decode."""
        key = ("decode", window, 0)
        if key not in self._windowed or self._windowed[key].dtype != dtype:
            lengths = self.decode_mask.sum(-1, keepdim=True)  # [1, num_decode, 1, 1]: the decode is at lengths - 1
            columns = torch.arange(self.decode_mask.shape[-1], device=self.decode_mask.device)
            old = columns <= lengths - 1 - window
            self._windowed[key] = self.decode_bias(dtype).masked_fill(old, float("-inf"))
        return self._windowed[key]

    def window_prefill_bias(self, index: int, window: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive [new tokens, context] bias of prefill ``index`` within ``window``; None where the
        plain causal mask (or the prefix context's bias) already hides nothing more."""
        start, end = self.prefill_bounds[index]
        context = self.prefill_contexts[index] if self.prefill_contexts else None
        length = end - start if context is None else context[1].shape[1]
        if length <= window:
            return None
        key = ("prefill", window, index)
        if key not in self._windowed:
            new = end - start
            device = self.slot_mapping.device
            rows = torch.arange(length - new, length, device=device).unsqueeze(1)  # positions of the new tokens
            columns = torch.arange(length, device=device).unsqueeze(0)
            visible = (columns <= rows) & (columns > rows - window)
            self._windowed[key] = torch.zeros(new, length, device=device).masked_fill_(~visible, float("-inf"))
        return self._windowed[key].to(dtype)

    def decode_index(self, kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
        """The decodes' blocks as rows of every layer's cache (same shape in each layer): block_index."""
        if self._decode_index is None:
            self._decode_index = block_index(self.decode_blocks, kv_cache, block_size)
        return self._decode_index

    def decode_kv(self, like: torch.Tensor, block_elems: int) -> torch.Tensor:
        """Scratch for the decodes' gathered K/V: [2 * kv_heads, num_decode * max_blocks, block_elems]."""
        shape = (like.shape[0] * like.shape[1], self.decode_blocks.numel(), block_elems)
        if self._decode_kv is None or self._decode_kv.shape != shape or self._decode_kv.dtype != like.dtype:
            self._decode_kv = like.new_empty(shape)
        return self._decode_kv


def block_index(blocks: torch.Tensor, kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """``blocks`` [m] as rows of the whole cache viewed as one table of blocks,
    ``[2 * kv_heads * num_blocks, block_size * head_dim]``: [2 * kv_heads * m], (K/V, head) major."""
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    num_blocks = kv_cache.shape[2] // block_size
    offsets = torch.arange(rows, device=blocks.device) * num_blocks
    return (offsets.unsqueeze(1) + blocks.unsqueeze(0)).view(-1)


def gather_blocks(kv_cache: torch.Tensor, index: torch.Tensor, block_size: int, out: torch.Tensor) -> torch.Tensor:
    """``out[j] = cache_j[blocks]`` for each (K or V, kv head) j, whole blocks at a time; ``index`` is
    ``block_index(blocks, ...)`` and ``out`` [2 * kv_heads, m, block_size * head_dim].

    One dim-0 ``index_select`` over the cache as a table of blocks, a run of block-sized memcpys:
    along the slot dimension it takes torch's generic strided path instead (2.4x slower on blocks in
    order, 6x on blocks scattered as a long-running worker's allocator leaves them), and one select
    per (K/V, head) row pays six op launches per layer (a batch-1 layer's gather 43 -> 5 us; batch 32
    357 -> 242 us in fp32, 141 -> 83 in bf16)."""
    table = kv_cache.view(-1, block_size * kv_cache.shape[-1])
    torch.index_select(table, 0, index, out=out.view(-1, out.shape[-1]))
    return out


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """kv_cache[0][:, slots] = k.transpose(0, 1), same for v; kv_cache [2, kv_heads, num_slots, head_dim]."""
    kv_cache[0].index_copy_(1, slots, k.transpose(0, 1))
    kv_cache[1].index_copy_(1, slots, v.transpose(0, 1))


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention, resolved at load: ``softmax(softcap(q k^T * scale) + mask) v``."""

    scale: float  # head_dim ** -0.5 for Llama
    window: int | None = None  # sliding window in tokens; None = global causal attention
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap (Gemma 2)
    native: bool = False  # decodes through kernels.native's paged kernel (CPU, fp32 / bf16) instead of the gather


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v for the decodes: q [kv_heads, n, group, d], k and v
    [kv_heads, n, length, d], bias [1, n, 1, length].

    Two batched matmuls and a softmax: for a decode's few query rows per KV head, 4% faster per
    decode step than SDPA's CPU flash kernel in fp32 and 2x faster in bf16 (batch 32, 2 threads).
    A half dtype's scores are scaled, masked and softmaxed in fp32 and the probabilities cast back
    for the second matmul, as transformers' eager attention does; on CUDA, SDPA's fused kernels win."""
    if q.dtype == torch.float32:
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(bias)
        return torch.matmul(torch.softmax(scores, -1), v)
    if q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale).add_(bias)
    return torch.matmul(torch.softmax(scores, -1).to(q.dtype), v)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """softmax(tanh(q k^T * scale / softcap) * softcap + bias) v, softmax in fp32 as transformers'
    eager attention does; q [..., rows, d] with k and v [..., length, d] of as many heads."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).div_(softcap).tanh_().mul_(softcap).add_(bias)
    return torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype), v)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, params: AttentionParams
) -> torch.Tensor:
    """q [heads, new, d], k and v [kv_heads, length, d]; mask [new, length] additive, None = causal."""
    gqa = k.shape[0] != q.shape[0]
    if params.softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=params.scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=params.scale, enable_gqa=gqa)
    if mask is None:
        mask = torch.full((q.shape[1], k.shape[1]), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    if gqa:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    return _softcapped_attention(q, k, v, mask, params.scale, params.softcap)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    out: torch.Tensor,
    params: AttentionParams | None = None,
) -> torch.Tensor:
    """Causal attention of every token; writes ``out`` [num_tokens, heads * head_dim] and returns it.

    q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim], this step's K/V
    (already written to ``kv_cache`` [2, kv_heads, num_slots, head_dim]). A prefill from an empty
    cache attends to its own fresh K/V; one past a cached prefix, and every decode, reads the cache.
    ``params`` defaults to Llama's: scale head_dim ** -0.5, no window, no soft-cap. With
    ``params.native`` the decodes read the cache in place through kernels.native's kernel; else their
    blocks are gathered into a scratch copy and attended with two batched matmuls.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    params = params or AttentionParams(head_dim**-0.5)
    window = params.window
    kv_heads = k.shape[1]
    n = meta.num_decode
    if n and params.native:
        tables = meta.decode_blocks.view(n, -1)
        paged_decode(
            q[:n], kv_cache, tables, meta.decode_lengths, out[:n], block_size, params.scale, params.softcap, window
        )
    elif n:
        # Heads sharing a KV head become that head's query rows: GQA without repeating K/V.
        dq = q[:n].view(n, kv_heads, heads // kv_heads, head_dim).transpose(0, 1)
        length = meta.decode_mask.shape[-1]
        gathered = gather_blocks(
            kv_cache,
            meta.decode_index(kv_cache, block_size),
            block_size,
            meta.decode_kv(kv_cache, block_size * head_dim),
        )
        dk, dv = gathered.view(2, kv_heads, n, length, head_dim)
        bias = meta.decode_bias(q.dtype) if window is None else meta.window_decode_bias(q.dtype, window)
        if params.softcap is None:
            res = _decode_attention(dq, dk, dv, bias, params.scale)
        else:
            res = _softcapped_attention(dq, dk, dv, bias, params.scale, params.softcap)
        out[:n].view(n, kv_heads, -1, head_dim).copy_(res.transpose(0, 1))
    contexts = meta.prefill_contexts or [None] * len(meta.prefill_bounds)
    for index, ((start, end), context) in enumerate(zip(meta.prefill_bounds, contexts, strict=True)):
        mask = None if window is None else meta.window_prefill_bias(index, window, q.dtype)
        if context is None:
            pk, pv = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        else:  # the prefix's K/V was written by an earlier step, or by another prefill earlier in this layer
            slots, causal = context
            pk, pv = kv_cache[0].index_select(1, slots), kv_cache[1].index_select(1, slots)
            mask = causal.to(q.dtype) if mask is None else mask
        res = _prefill_attention(q[start:end].transpose(0, 1), pk, pv, mask, params)
        out[start:end].view(end - start, heads, head_dim).copy_(res.transpose(0, 1))
    return out
