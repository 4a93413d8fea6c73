"""The CPU kernels of ``csrc/`` (paged decode attention, LoRA shrink / expand, a layer's element-wise
steps), built for this machine on first use.

``torch.ops.lorafleet.paged_decode`` reads each decode's K/V where it lies in the block-paged cache,
one task per (sequence, KV head) over torch's intra-op threads, and keeps scores, softmax and the
weighted sum of V in fp32 (bf16 K/V widened on load). The eager path it replaces gathers every
block into a scratch copy, then reads it twice more in two batched matmuls and a softmax.

``torch.ops.lorafleet.lora_bgmv`` adds each token's own adapter delta to the outputs of a group of
projections that read the same input (q/k/v, gate/up, or one projection) in a single call, each into
its columns of the fused output: the token's A and B read in place (one streamed pass each), fp32
accumulation, tokens over torch's intra-op threads. The eager forms it replaces pay several op launches per projection
(the segment loop: two matmuls per adapter; the bags: two embedding bags, a scale and a scatter).

``rms_norm``, ``add_rms_norm`` (the residual add fused with the next norm), ``rope_write_kv`` (rotary
embedding of q and k in place, fused with the K/V cache write) and ``act_mul`` (the gated MLP's
activation times up) are the steps between a layer's matmuls, one call each where the eager chains
take about ten ops (RMSNorm) or five (RoPE and the cache write): at batch 1 those launches, not the
arithmetic, were most of a decode step's time outside the matmuls. Their results are rounded where
the eager ops round them (see the sources). ``argmax_rows`` is the greedy sampler's argmax, vectorised
and over the threads where torch's reduces a row on one thread.

The dense projections' ops (kernels/projections.py wraps them): ``small_linear`` (a decode batch's projections of up to eight rows: the weight streamed once for all
of them) and ``panel_linear`` (any row count, through a weight packed once by ``panel_pack`` into
24-feature panels under a register-tiled FMA kernel: on AVX2 CPUs 1.0-1.8x oneDNN's fp32 GEMM, and
the bf16 GEMM oneDNN lacks there) and ``panel_linear_dot`` (bf16 at any row count through
AVX512-BF16's vdpbf16ps, the weight packed by ``panel_pack_dot`` into 32-feature panels of input
pairs; built only where the CPU has it) are the dense projections' native paths
(services/worker/engine/linear.py says which rows take which).

``torch.classes.lorafleet.DecoderStack`` (``decoder_stack.cpp``) holds a model's layers and runs a
decode step's whole layer loop in one call, calling the ops above (and ``lora_bgmv``) through torch's
dispatcher where the Python loop calls them one by one (services/worker/engine/layer_loop.py).

The sources are compiled once per machine with torch's C++ extension builder (g++ and ninja, about
a minute on two cores) for the CPU it runs on (``-march=native``), under a name that carries a digest
of the sources, the flags and this CPU's instruction sets, so a build is never loaded on a CPU it was
not built for; kernels/native_build.py finds a prebuilt or cached library, or builds one in a child
process bounded in time (``lorafleet kernels build`` builds ahead). :func:`native_decode`, :func:`native_lora`,
:func:`native_layer_ops` and kernels/projections.py's probes build it once
per process and probe their ops against the eager paths; where
the build or a probe fails they log why and return False, and the engine and the adapter manager keep
the eager paths (a setting of ``native`` refuses to start instead).
"""

import functools
from collections.abc import Sequence

import structlog
import torch

from kernels import native_build

log = structlog.get_logger("kernels")

DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256  # kMaxHeadDim in the source


@functools.cache
def built() -> bool:
    """Whether the extension is loaded here: found prebuilt or in the cache, else built (at most one
    build per process, in a child process, bounded in time; kernels/native_build.py)."""
    try:
        found = native_build.library()
        torch.ops.load_library(str(found.path))  # type: ignore[no-untyped-call]
    except Exception as e:  # a missing compiler, a failed or overrunning build, a failed load: the eager paths serve
        log.warning("native_kernels_unavailable", error=str(e)[-2000:])
        return False
    log.info("native_kernels_loaded", path=str(found.path), origin=found.origin, build_s=round(found.build_s, 1))
    return True


@functools.cache
def native_decode() -> bool:
    """Whether ``torch.ops.lorafleet.paged_decode`` is built, loaded and agrees with the eager decode
    attention here (fp32 and bf16, GQA, a window, a soft-cap)."""
    return built() and _probe_decode()


@functools.cache
def native_lora() -> bool:
    """Whether ``torch.ops.lorafleet.lora_bgmv`` is built, loaded and agrees with the eager LoRA path
    here (fp32 and bf16, compiled and run-time ranks, scattered tokens, a column view of y)."""
    return built() and _probe_lora()


def paged_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """``out[s]`` = attention of decode ``s``'s query heads over its first ``lengths[s]`` cached
    positions (the last ``window`` of them with a window), soft-capped before the softmax with a cap.

    q [n, heads, head_dim] (contiguous head_dim); cache [2, kv_heads, num_slots, head_dim]
    contiguous; tables [n, width] int64 block ids; lengths [n] int64 >= 1; out [n, heads * head_dim]
    (contiguous rows); fp32 or bf16. Call only where :func:`native_decode` is True."""
    torch.ops.lorafleet.paged_decode(q, cache, tables, lengths, out, block_size, scale, softcap or 0.0, window or 0)


@functools.cache
def native_layer_ops() -> bool:
    """Whether ``rms_norm``, ``add_rms_norm``, ``rope_write_kv``, ``act_mul`` and ``argmax`` are built,
    loaded and agree with the eager ops here (fp32 and bf16, Gemma's fp32 norm, a residual multiplier,
    both activations; argmax exactly, ties and NaN included)."""
    return built() and _probe_layer_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (d,), weight, eps)`` of x [rows, d] (contiguous rows) -> a new [rows, d] of x's
    dtype; weight [d] of x's dtype or fp32 (Gemma's 1 + w: transformers' fp32 norm, one rounding at
    the end, the same values). Call only where :func:`native_layer_ops` is True."""
    out: torch.Tensor = torch.ops.lorafleet.rms_norm(x, weight, eps)
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, residual_mul: float = 1.0
) -> torch.Tensor:
    """``h += delta * residual_mul`` in place (the residual stream, each product and sum rounded to h's
    dtype as the eager ops round them), then ``rms_norm(h, weight, eps)``."""
    out: torch.Tensor = torch.ops.lorafleet.add_rms_norm(h, delta, weight, eps, residual_mul)
    return out


def rope_write_kv(
    qk: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor
) -> None:
    """Rotate qk [n, heads + kv_heads, d] (q heads, then k heads) in place by cos_sin [n, 2, d] (cos,
    signed sin: rope.cos_sin_table's rows), then write each token's k heads and v [n, kv_heads, d] to
    its slot of cache [2, kv_heads, num_slots, d]."""
    torch.ops.lorafleet.rope_write_kv(qk, v, cos_sin, slots, cache)


def act_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    """``act(gate) * up`` of gate_up [rows, 2 * inter] (gate columns, then up; contiguous rows) -> a new
    [rows, inter] of its dtype; act SiLU, or GELU with the tanh approximation, in fp32 and rounded where
    the eager ``act(gate).mul_(up)`` rounds: SiLU within a few ulp of eager (the exp differs), GELU as
    x * sigmoid(2y), more accurate than eager's 0.5 x (1 + tanh y) where that cancels (see the source)."""
    out: torch.Tensor = torch.ops.lorafleet.act_mul(gate_up, gelu_tanh)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a CPU fp32 x [rows, n] with contiguous rows (the first among equal maxima, a
    NaN counting as the largest); other tensors go to torch."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1 or not x.shape[1]:
        return x.argmax(-1)
    out: torch.Tensor = torch.ops.lorafleet.argmax_rows(x)
    return out


def _probe_layer_ops() -> bool:
    """The layer ops and the argmax against the eager chains they replace, each dtype (the norms within an fp32 sum's
    reordering); False (logged) on a disagreement."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    d, heads, kv_heads, n = 64, 3, 1, 5
    for dtype in DTYPES:

        def close(got: torch.Tensor, want: torch.Tensor) -> bool:
            error = (got.float() - want.float()).abs().max()
            return bool(error <= tolerance[dtype] * want.float().abs().max())  # noqa: B023

        x = torch.randn(n, d, generator=generator).to(dtype)
        delta = torch.randn(n, d, generator=generator).to(dtype)
        weight = torch.randn(d, generator=generator).to(dtype)
        wide = (1 + torch.randn(d, generator=generator)).float()
        checks = {
            "rms_norm": close(rms_norm(x, weight, 1e-6), F.rms_norm(x, (d,), weight, 1e-6)),
            "rms_norm fp32 weight": close(rms_norm(x, wide, 1e-6), F.rms_norm(x.float(), (d,), wide, 1e-6).to(dtype)),
        }
        gate_up = (4 * torch.randn(n, 2 * d + 6, generator=generator)).to(dtype)  # a tail past the vector width
        gate, up = gate_up[:, : d + 3], gate_up[:, d + 3 :]
        checks["act_mul silu"] = close(act_mul(gate_up, False), F.silu(gate) * up)
        checks["act_mul gelu_tanh"] = close(act_mul(gate_up, True), F.gelu(gate, approximate="tanh") * up)
        h = x.clone()
        want_h = x + delta * 0.5
        checks["add_rms_norm"] = close(
            add_rms_norm(h, delta, weight, 1e-6, 0.5), F.rms_norm(want_h, (d,), weight, 1e-6)
        )
        checks["add_rms_norm residual"] = torch.equal(h, want_h)
        # RoPE as services/worker/engine/rope.py's apply_rope computes it, over scattered cache slots
        qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=generator).to(dtype)
        qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        cos_sin = torch.randn(n, 2, d, generator=generator).to(dtype)
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)
        want_qk = torch.addcmul(qk * cos, torch.roll(qk, d // 2, -1), sin)
        want_v = v.clone()
        slots = torch.tensor([7, 0, 3, 12, 9])
        cache = torch.zeros(2, kv_heads, 16, d, dtype=dtype)
        rope_write_kv(qk, v, cos_sin, slots, cache)
        checks["rope"] = close(qk, want_qk)
        checks["kv write"] = torch.equal(cache[0][:, slots], qk[:, heads:].transpose(0, 1)) and torch.equal(
            cache[1][:, slots], want_v.transpose(0, 1)
        )
        logits = torch.randn(4, 1003, generator=generator)
        logits[1, [5, 700]] = 9.0  # a tie: the first wins
        logits[2] = float("-inf")
        logits[3, [17, 900]] = float("nan")  # a NaN counts as the largest
        checks["argmax"] = torch.equal(argmax(logits), logits.argmax(-1))
        if not all(checks.values()):
            log.warning("native_layer_ops_probe_failed", dtype=str(dtype), checks=checks)
            return False
    return True


def lora_bgmv(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
) -> None:
    """``y[t] += scale[row] * (x[t] @ a[row]) @ b[row]`` for each (t, row) in zip(token_idx, token_row),
    in place, fp32 arithmetic; shapes and dtypes as ``reference.add_lora_gathered`` (x, y, a, b share
    fp32 or bf16; a, b contiguous; x, y with contiguous rows). Call only where :func:`native_lora` is True."""
    torch.ops.lorafleet.lora_bgmv(x, y, [a], [b], [0], scale, token_idx, token_row)


def lora_bgmv_group(
    x: torch.Tensor,
    y: torch.Tensor,
    a: Sequence[torch.Tensor],
    b: Sequence[torch.Tensor],
    cols: Sequence[int],
    scale: torch.Tensor,
    token_idx: torch.Tensor,
    token_row: torch.Tensor,
) -> None:
    """:func:`lora_bgmv` for several projections that read the same x in one call: projection m adds
    into y's columns ``[cols[m], cols[m] + b[m].shape[2])`` (disjoint, inside y); every a[m] has the
    same slots and rank. Call only where :func:`native_lora` is True."""
    torch.ops.lorafleet.lora_bgmv(x, y, a, b, cols, scale, token_idx, token_row)


def _probe_lora() -> bool:
    """The kernel against the eager gathered form: each dtype, a compiled rank (16) and a run-time
    one (12), scattered tokens into two projections' columns of a wider output (one of them alone,
    then both in one call); False (logged) on any disagreement."""
    from kernels.reference import INDEX_DTYPE, add_lora_gathered

    generator = torch.Generator().manual_seed(0)
    token_idx = torch.tensor([4, 0, 2], dtype=INDEX_DTYPE)
    token_row = torch.tensor([0, 2, 2], dtype=INDEX_DTYPE)
    for dtype in DTYPES:
        for rank in (16, 12):
            x = torch.randn(5, 40, generator=generator).to(dtype)
            a = torch.randn(3, 40, rank, generator=generator).to(dtype)
            b = torch.randn(3, rank, 300, generator=generator).to(dtype)
            a2 = torch.randn(3, 40, rank, generator=generator).to(dtype)
            b2 = torch.randn(3, rank, 17, generator=generator).to(dtype)
            scale = torch.rand(3, generator=generator)
            fused = torch.randn(5, 320, generator=generator).to(dtype)
            want = fused.clone()
            add_lora_gathered(x, want[:, 20:], a, b, scale, token_idx, token_row)
            lora_bgmv(x, fused[:, 20:], a, b, scale, token_idx, token_row)
            add_lora_gathered(x, want[:, 20:], a, b, scale, token_idx, token_row)
            add_lora_gathered(x, want[:, :17], a2, b2, scale, token_idx, token_row)
            lora_bgmv_group(x, fused, [a, a2], [b, b2], [20, 0], scale, token_idx, token_row)
            # relative to the output's magnitude: bf16 rounds the delta and the sum, each within 2^-8
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            error = (fused.float() - want.float()).abs().max()
            if not error <= tolerance * want.float().abs().max():
                log.warning("native_lora_probe_failed", dtype=str(dtype), rank=rank)
                return False
    return True


def _probe_decode() -> bool:
    """The kernel against the eager formula on a small scattered cache: each dtype, with and
    without a window and a soft-cap; False (logged) on any disagreement."""
    generator = torch.Generator().manual_seed(0)
    block, kv_heads, heads, dim = 4, 2, 6, 16
    lengths = torch.tensor([1, 7, 13])
    tables = torch.tensor([[5, 0, 0, 0], [2, 7, 0, 0], [1, 3, 6, 4]])
    for dtype in DTYPES:
        cache = torch.randn(2, kv_heads, 8 * block, dim, generator=generator).to(dtype)
        q = torch.randn(3, heads, dim, generator=generator).to(dtype)
        for softcap, window in ((None, None), (5.0, 5)):
            out = q.new_empty(3, heads * dim)
            paged_decode(q, cache, tables, lengths, out, block, dim**-0.5, softcap, window)
            for s, length in enumerate(lengths.tolist()):
                first = max(0, length - window) if window else 0
                slots = torch.tensor([int(tables[s, p // block]) * block + p % block for p in range(first, length)])
                k, v = cache[0][:, slots].float(), cache[1][:, slots].float()
                scores = q[s].float().view(kv_heads, -1, dim) @ k.transpose(1, 2) * dim**-0.5
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                want = (torch.softmax(scores, -1) @ v).reshape(-1)
                tolerance = 1e-5 if dtype == torch.float32 else 2e-2
                if not torch.allclose(out[s].float(), want, atol=tolerance, rtol=tolerance):
                    log.warning("native_decode_attention_probe_failed", dtype=str(dtype), row=s)
                    return False
    return True
