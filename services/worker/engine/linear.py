"""The engine's dense projections: torch's ``F.linear``, or on CPU a oneDNN-prepacked weight, in fp32
and bf16.

On CPU, ``F.linear`` runs MKL's sgemm, which on non-Intel processors (such as the AMD EPYC this
project's CI runs on) takes a generic code path. oneDNN with the weight reordered once into its
blocked layout is faster there at every row count: for 1-7 rows it reads the weights near the memory
bandwidth, where MKL's matrix-vector path reaches about a third of it (a batch-1 step's projections
and lm_head 38 -> 13 ms, the whole step 47 -> 22 ms), 1.2-2.3x at 8-128 rows, and 2.0-2.4x on a
prefill of 129-1405 rows (SmolLM2's four projections, 2 threads). In bf16, ``F.linear`` already runs
oneDNN: the packed path is 2x faster at one row and within 10% of it past 128. So ``auto`` packs
every projection where the probe passes, keeping the plain weight too (the transformers model shares
it; ``torch`` mode and a failed probe use it), at the price of holding the dense weights twice.

The packed path is ``torch.ops.mkldnn._linear_pointwise``, the op torch's own inductor emits for
CPU linears; a probe at load time checks it exists and agrees with ``F.linear`` before any
weight is packed, else ``auto`` stays on ``F.linear`` (``onednn`` refuses to start).

A small decode batch's projections (up to :func:`small_rows` rows) go one step further in ``auto``:
kernels.native's ``small_linear`` streams the plain weight once for all the rows with software
prefetch, where oneDNN's packed matrix-vector path reaches about two thirds of the read bandwidth
(30 layers of SmolLM2's projections at one row, fp32: 14.2 -> 13.1 ms; four rows 16.3 -> 12.5 ms;
bf16 9.4 -> 7.1 and 11.1 -> 7.5 ms; bf16 from four rows through AVX512-BF16's dot product where the
CPU has it, an engine decode step 1.37x faster than the packed path at four rows, 1.05x at six and
eight). It is probed at load like the other native kernels; where it
is not usable the rows take the packed path.

bf16 where oneDNN has no bf16 GEMM (CPUs without AVX-512, such as the AMD EPYC above): ``F.linear``
in bf16 there is torch's reference GEMM, about 16 GFLOP/s against 100 and more for fp32 (a 576 ->
1536 projection at 32 rows 3.6 against 0.6 ms). ``auto`` sends those rows to kernels.native's
``panel_linear`` instead, which widens the bf16 weight to fp32 sixteen features at a time under an
fp32 FMA kernel and rounds once (the same values as a bf16 GEMM with an fp32 accumulator, up to the
order of the sum): 5.7x the reference GEMM at 32 rows, within 15-25% of oneDNN's fp32 GEMM, with the
weights kept bf16 in memory. Without the native build, the engine logs at load that bf16 runs on the
reference GEMM here.
"""

from dataclasses import dataclass
from typing import Literal

import structlog
import torch
import torch.nn.functional as F

from kernels import native

CpuLinear = Literal["auto", "torch", "onednn"]
log = structlog.get_logger("engine")
BF16_WIDENING_ROWS = 4  # bf16 rows the kernel takes without AVX512-BF16's dot product


def small_rows(dtype: torch.dtype) -> int:
    """Rows up to which ``auto`` takes kernels.native's small-row kernel rather than oneDNN's packed
    path (0: none), where it was faster over 30 layers of SmolLM2's projections (weights streamed
    from memory, 2 threads): fp32 1.1x at one row, 1.3-1.5x at 2-4, 1.2x at 8; bf16 1.3x at one row,
    1.5-1.8x at 2-4, and at 5-8 only where the build has vdpbf16ps (widening the bf16 weights costs
    more than the pass saves there). Where oneDNN has no bf16 GEMM (AVX2), bf16 takes eight rows, as
    the alternative is kernels.native's panel kernel: 30 layers of SmolLM2's projections, 2 threads,
    AVX2, the small-row kernel 2.8x the panel's speed at one row, 1.4x at eight (fp32 there: 1.3-2.3x
    oneDNN's packed path at 1-8 rows). Call only where ``native_small_linear()`` is True."""
    if dtype == torch.float32:
        return native.SMALL_LINEAR_ROWS
    if dtype == torch.bfloat16:
        if native.small_linear_dot_bf16() or not onednn_usable(dtype):
            return native.SMALL_LINEAR_ROWS
        return BF16_WIDENING_ROWS
    return 0


def padded_rows(rows: int) -> int:
    """The row count a packed matmul of ``rows`` rows runs at: 1 (a batch-1 decode, unpadded: its
    matrix-vector kernel reads the weight once, 1.3x faster than padding it to 8), then 8, 16, 24,
    32, then four steps per doubling (40, 48, 56, 64, 80, 96, 112, 128, 160, ...), so past one row
    at most 25% of the rows are padding.

    oneDNN builds and keeps a primitive per input shape, about 2.3 MB for this model's projections
    together at each row count: over the 121 row counts of 8-128 that was +282 MB of worker RSS,
    reached slowly as prompts of new lengths arrived (the soak saw it as a creep). Thirteen buckets
    there bound it to a tenth of that, reached within minutes; prefills add four per doubling (16 up
    to a 2048-token step)."""
    if rows <= 1:
        return rows
    if rows <= 32:
        return -(-rows // 8) * 8
    step = 1 << (rows - 1).bit_length() - 3
    return -(-rows // step) * step


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.shape[0]
    padded = padded_rows(rows)
    if padded != rows:
        x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
    # torch.ops resolves its operators at run time, so mypy sees Any
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:rows] if padded != rows else out


def _pack(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    return packed


# The probe's tolerance per dtype: both sides accumulate in fp32, a bf16 output is rounded to 8 bits.
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def onednn_usable(dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN linears work here for ``dtype`` and agree with ``F.linear``: fp32, and
    bf16 where oneDNN has a bf16 path on this CPU (AVX-512 BF16 or AMX natively, AVX-512BW emulated)."""
    # torch leaves torch.backends.mkldnn.is_available unannotated
    if dtype not in _PROBE_TOLERANCE or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 40, generator=generator).to(dtype)
        bias = torch.randn(48, generator=generator).to(dtype)
        tolerance = _PROBE_TOLERANCE[dtype]
        for rows in (1, 9):  # the unpadded matrix-vector path and a padded one
            x = torch.randn(rows, 40, generator=generator).to(dtype)
            got = _packed_linear(x, _pack(weight), bias)
            if not torch.allclose(got, F.linear(x, weight, bias), rtol=tolerance, atol=tolerance):
                return False
        return True
    except (RuntimeError, AttributeError) as e:
        log.warning("onednn_linear_unavailable", error=str(e))
        return False


@dataclass(slots=True)
class Linear:
    """``y = x @ weight.T + bias``: up to ``small_rows`` rows through kernels.native's small-row
    kernel, the rest through ``packed`` when there is one, else ``F.linear``."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # oneDNN's blocked layout of weight
    small_rows: int = 0  # 0: no small-row kernel
    panel: bool = False  # rows past small_rows through kernels.native's panel_linear (bf16 without oneDNN)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_rows and x.shape[0] > 0:
            return native.small_linear(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        if self.panel:
            return native.panel_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class LinearFactory:
    """Builds every projection of one model under one policy (probed once)."""

    def __init__(self, mode: CpuLinear, device: str, dtype: torch.dtype):
        cpu = torch.device(device).type == "cpu"
        wanted = mode != "torch" and cpu
        self.pack = wanted and onednn_usable(dtype)
        if wanted and not self.pack and mode == "onednn":
            raise ValueError(f"cpu_linear='onednn' is not usable here for {dtype} (see the engine log)")
        auto = mode == "auto" and wanted
        self.small_rows = small_rows(dtype) if auto and native.native_small_linear() else 0
        reference_bf16 = cpu and dtype == torch.bfloat16 and not self.pack
        self.panel = auto and reference_bf16 and native.native_panel_linear()
        if self.panel:
            log.info(
                "bf16_linear_widened", detail="no oneDNN bf16 GEMM on this CPU: bf16 weights widened to fp32 panels"
            )
        elif reference_bf16:
            log.warning(
                "bf16_linear_reference_gemm",
                detail="no oneDNN bf16 GEMM on this CPU and no native panel kernel: bf16 projections past "
                f"{self.small_rows} rows run torch's reference GEMM, several times slower than fp32",
                cpu_linear=mode,
            )

    def __call__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        packed = _pack(weight) if self.pack else None
        weight, bias = weight.contiguous(), bias.contiguous() if bias is not None else None
        return Linear(weight, bias, packed, self.small_rows, self.panel)
