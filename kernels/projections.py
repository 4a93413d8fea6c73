"""The dense projections' native ops, built with the rest of kernels/native.py's extension:
``small_linear`` (up to eight rows, the weight streamed once for all), ``panel_linear`` (any rows,
a weight packed into 24-feature panels), ``panel_linear_wide`` (fp32 through AVX-512's sixteen-lane
FMAs) and ``panel_linear_dot`` (bf16 through AVX512-BF16), each
with the probe that checks it against ``F.linear`` once per process before the engine uses it
(services/worker/engine/linear.py says which rows take which)."""

import functools
from collections.abc import Callable, Iterable, Sequence

import structlog
import torch

from kernels import native, native_build

log = structlog.get_logger("kernels")
DTYPES = native.DTYPES
FP32, BF16 = DTYPES


SMALL_LINEAR_ROWS = 8  # kMaxRows in the source


@functools.cache
def native_small_linear() -> bool:
    """Whether ``small_linear`` is built, loaded and agrees with ``F.linear`` here (fp32 and bf16,
    every row count it takes, with and without a bias, a width that is not a multiple of 16)."""
    return native.built() and _probe_small_linear()


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [rows, in] with 1 <= rows <= SMALL_LINEAR_ROWS (contiguous
    rows), weight [out, in] contiguous, bias [out] or None, all fp32 or all bf16 -> a new [rows, out]
    (fp32 sums, rounded once to bf16). Call only where :func:`native_small_linear` is True."""
    out: torch.Tensor = torch.ops.lorafleet.small_linear(x, weight, bias)
    return out


@functools.cache
def native_small_linear_int8() -> bool:
    """Whether ``small_linear_int8`` is built, loaded and agrees with ``F.linear`` over the dequantized
    weight here (fp32 and bf16 rows, every row count it takes, with and without a bias)."""
    return native.built() and _probe_small_linear_int8()


def small_linear_int8(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ (codes * scales[:, None]).T + bias`` for x [rows, in] with 1 <= rows <= SMALL_LINEAR_ROWS
    (contiguous rows, fp32 or bf16), codes [out, in] int8 contiguous, scales and bias [out] in x's dtype
    -> a new [rows, out] in x's dtype (fp32 sums scaled once per feature, rounded once). Call only where
    :func:`native_small_linear_int8` is True."""
    out: torch.Tensor = torch.ops.lorafleet.small_linear_int8(x, codes, scales, bias)
    return out


def _probe_small_linear_int8() -> bool:
    """small_linear_int8 against the fp32 ``F.linear`` over ``codes * scales`` (fp32 and bf16 rows and
    scales, every row count, with and without a bias, a width that is no multiple of a vector)."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    codes = torch.randint(-127, 128, (37, 53), generator=generator, dtype=torch.int8)
    for dtype in DTYPES:
        scales = (torch.rand(37, generator=generator) / 50).to(dtype)
        weight = codes.float() * scales.float()[:, None]
        bias = torch.randn(37, generator=generator).to(dtype)
        for rows in range(1, SMALL_LINEAR_ROWS + 1):
            x = torch.randn(rows, 53, generator=generator).to(dtype)
            for b in (bias, None):
                want = F.linear(x.float(), weight, None if b is None else b.float())
                error = (small_linear_int8(x, codes, scales, b).float() - want).abs().max()
                if not error <= tolerance[dtype] * want.abs().max():
                    log.warning(
                        "native_small_linear_int8_probe_failed", dtype=str(dtype), rows=rows, bias=b is not None
                    )
                    return False
    return True


@functools.cache
def native_small_linear_int4() -> bool:
    """Whether ``small_linear_int4`` is built, loaded and agrees with ``F.linear`` over the dequantized
    weight here (fp32 and bf16 rows, every row count it takes, symmetric and asymmetric groups, a bias)."""
    return native.built() and _probe_small_linear_int4()


INT4_GROUP_MULTIPLE = 32  # kGroupMultiple in the source: a group size it takes is a multiple of this


def small_linear_int4(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """``x @ ((q - z) * s).T + bias`` for x [rows, in] with 1 <= rows <= SMALL_LINEAR_ROWS (contiguous
    rows, fp32 or bf16); codes [out, in / 2] uint8, two 4-bit q a byte (even inputs in the low nibble);
    scales [out, in / group] in x's dtype; zeros [out, in / group] uint8 z, or None for z = 8; bias [out]
    in x's dtype; ``group`` a multiple of INT4_GROUP_MULTIPLE dividing ``in`` -> a new [rows, out] in x's
    dtype (fp32 sums, each group's scaled once, rounded once). Call only where
    :func:`native_small_linear_int4` is True."""
    out: torch.Tensor = torch.ops.lorafleet.small_linear_int4(x, codes, scales, zeros, bias, group)
    return out


def _probe_small_linear_int4() -> bool:
    """small_linear_int4 against the fp32 ``F.linear`` over ``(q - z) * s`` (fp32 and bf16 rows and scales,
    every row count, groups of 32 and 64, z = 8 and per-group z, with and without a bias)."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    out, inp = 37, 128
    q = torch.randint(0, 16, (out, inp), generator=generator, dtype=torch.uint8)
    codes = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    for dtype in DTYPES:
        bias = torch.randn(out, generator=generator).to(dtype)
        for group in (32, 64):
            scales = (torch.rand(out, inp // group, generator=generator) / 50).to(dtype)
            for zeros in (None, torch.randint(0, 16, (out, inp // group), generator=generator, dtype=torch.uint8)):
                z = 8.0 if zeros is None else zeros.float().repeat_interleave(group, dim=1)
                weight = (q.float() - z) * scales.float().repeat_interleave(group, dim=1)
                for rows in range(1, SMALL_LINEAR_ROWS + 1):
                    x = torch.randn(rows, inp, generator=generator).to(dtype)
                    b = bias if rows % 2 else None
                    want = F.linear(x.float(), weight, None if b is None else b.float())
                    error = (small_linear_int4(x, codes, scales, zeros, b, group).float() - want).abs().max()
                    if not error <= tolerance[dtype] * want.abs().max():
                        log.warning("native_small_linear_int4_probe_failed", dtype=str(dtype), rows=rows, group=group)
                        return False
    return True


def small_linear_dot_bf16() -> bool:
    """Whether the build takes bf16 batches of four rows and more through AVX512-BF16's dot product
    (vdpbf16ps), where it is faster than oneDNN's packed path up to SMALL_LINEAR_ROWS rows. Call only
    where :func:`native_small_linear` is True."""
    return bool(torch.ops.lorafleet.small_linear_dot_bf16())


@functools.cache
def amx_bf16() -> bool:
    """Whether this CPU has AMX's bf16 tile multiply (oneDNN's bf16 GEMM runs on it: on a 2-core Xeon,
    SmolLM2's projections at 16-128 rows took 1.5-5x as long through :func:`panel_linear_dot`)."""
    return "amx_bf16" in native_build.cpu_flags().split()


def _probe_small_linear() -> bool:
    return _probe_projection(small_linear, range(1, SMALL_LINEAR_ROWS + 1), "native_small_linear_probe_failed")


def _probe_projection(
    op: Callable[..., torch.Tensor], row_counts: Iterable[int], event: str, dtypes: Sequence[torch.dtype] = DTYPES
) -> bool:
    """``op(x, weight, bias)`` against the fp32 ``F.linear`` for each dtype and row count, with and
    without a bias, at widths that are no multiple of a vector; False (logged as ``event``) on any
    disagreement."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(0)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    for dtype in dtypes:
        weight = torch.randn(37, 53, generator=generator).to(dtype)
        bias = torch.randn(37, generator=generator).to(dtype)
        for rows in row_counts:
            x = torch.randn(rows, 53, generator=generator).to(dtype)
            for b in (bias, None):
                want = F.linear(x.float(), weight.float(), None if b is None else b.float())
                error = (op(x, weight, b).float() - want).abs().max()
                if not error <= tolerance[dtype] * want.abs().max():
                    log.warning(event, dtype=str(dtype), rows=rows, bias=b is not None)
                    return False
    return True


@functools.cache
def native_panel_linear() -> bool:
    """Whether ``panel_pack`` and ``panel_linear`` are built, loaded and agree with the fp32
    ``F.linear`` here (fp32 and bf16, row counts around the four-row tile, with and without a bias,
    widths that are not multiples of the 24-feature panel)."""
    return native.built() and _probe_panel_linear()


def panel_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (fp32 or bf16) packed for :func:`panel_linear`: panels of 24 output
    features, [ceil(out / 24), in, 24] in the weight's dtype, zero past the last feature."""
    packed: torch.Tensor = torch.ops.lorafleet.panel_pack(weight)
    return packed


def panel_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [rows, in] (any rows, fp32 or bf16 as the weight was),
    ``packed = panel_pack(weight)``, ``features = weight.shape[0]``, bias [features] or None -> a new
    [rows, features]: fp32 FMA sums (bf16 widened exactly), rounded once to bf16 for bf16. Call only
    where :func:`native_panel_linear` is True."""
    out: torch.Tensor = torch.ops.lorafleet.panel_linear(x, packed, bias, features)
    return out


def panel_linear_preferred() -> bool:
    """Whether the build's panel kernel is the one to take over oneDNN here: it is AVX2 + FMA and this
    CPU has no AVX-512, where it was measured 1.0-1.8x oneDNN's fp32 GEMM from 9 to 1400 rows
    (SmolLM2's projections, 2 threads) and oneDNN has no bf16 GEMM at all. On AVX-512 CPUs the
    sixteen-lane kernels (:func:`native_panel_wide`, oneDNN's) are faster. Call only where :func:`native_panel_linear` is True."""
    return bool(torch.ops.lorafleet.panel_avx2()) and "avx512f" not in native_build.cpu_flags().split()


@functools.cache
def native_panel_dot() -> bool:
    """Whether ``panel_pack_dot`` and ``panel_linear_dot`` (bf16 through AVX512-BF16's vdpbf16ps)
    are built for this CPU, loaded, and agree with the fp32 ``F.linear`` here (row counts around the
    eight-row tile, with and without a bias, widths that are no multiple of the 32-feature panel and
    an odd input width)."""
    if not native.built() or not torch.ops.lorafleet.panel_dot_bf16():
        return False
    return _probe_panel(panel_pack_dot, panel_linear_dot, (1, 7, 8, 9, 17), "native_panel_dot_probe_failed", (BF16,))


def panel_pack_dot(weight: torch.Tensor) -> torch.Tensor:
    """bf16 ``weight`` [out, in] packed for :func:`panel_linear_dot`: panels of 32 output features
    with the input features in pairs, [ceil(out / 32), ceil(in / 2), 32, 2], zero past the ends."""
    packed: torch.Tensor = torch.ops.lorafleet.panel_pack_dot(weight)
    return packed


def panel_linear_dot(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in bf16 for x [rows, in] (any rows), ``packed =
    panel_pack_dot(weight)``, ``features = weight.shape[0]`` -> a new [rows, features]: fp32 sums of
    exact bf16 products (vdpbf16ps), rounded once to bf16. Call only where :func:`native_panel_dot`
    is True."""
    out: torch.Tensor = torch.ops.lorafleet.panel_linear_dot(x, packed, bias, features)
    return out


@functools.cache
def native_panel_wide() -> bool:
    """Whether ``panel_pack_wide`` and ``panel_linear_wide`` (fp32 through AVX-512's sixteen-lane
    FMAs) are built for this CPU, loaded, and agree with ``F.linear`` here (row counts around the
    eight-row tile, with and without a bias, widths that are no multiple of the 32-feature panel)."""
    if not native.built() or not torch.ops.lorafleet.panel_wide_avx512():
        return False
    return _probe_panel(panel_pack_wide, panel_linear_wide, (1, 7, 8, 9, 17), "native_panel_wide_probe_failed", (FP32,))


def panel_pack_wide(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``weight`` [out, in] packed for :func:`panel_linear_wide`: panels of 32 output features,
    [ceil(out / 32), in, 32], zero past the last feature."""
    packed: torch.Tensor = torch.ops.lorafleet.panel_pack_wide(weight)
    return packed


def panel_linear_wide(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in fp32 for x [rows, in] (any rows), ``packed =
    panel_pack_wide(weight)``, ``features = weight.shape[0]`` -> a new [rows, features]: fp32 FMA sums
    in input order. Call only where :func:`native_panel_wide` is True."""
    out: torch.Tensor = torch.ops.lorafleet.panel_linear_wide(x, packed, bias, features)
    return out


def _probe_panel_linear() -> bool:
    return _probe_panel(panel_pack, panel_linear, (1, 3, 4, 5, 9), "native_panel_linear_probe_failed")


def _probe_panel(
    pack: Callable[[torch.Tensor], torch.Tensor],
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int], torch.Tensor],
    row_counts: Iterable[int],
    event: str,
    dtypes: Sequence[torch.dtype] = DTYPES,
) -> bool:
    """A panel kernel's ``linear(x, pack(weight), bias, features)`` through :func:`_probe_projection`."""

    def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, pack(weight), bias, weight.shape[0])

    return _probe_projection(packed_linear, row_counts, event, dtypes)
