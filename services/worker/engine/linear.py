"""The engine's dense projections: torch's ``F.linear``, or on CPU a oneDNN-prepacked weight or
kernels.projections' small-row and panel kernels, in fp32 and bf16.

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
kernels.projections' ``small_linear`` streams the plain weight once for all the rows with software
prefetch, where oneDNN's packed matrix-vector path reaches about two thirds of the read bandwidth
(30 layers of SmolLM2's projections at one row, fp32: 14.2 -> 13.1 ms; four rows 16.3 -> 12.5 ms;
bf16 9.4 -> 7.1 and 11.1 -> 7.5 ms; bf16 from four rows through AVX512-BF16's dot product where the
CPU has it, an engine decode step 1.37x faster than the packed path at four rows, 1.05x at six and
eight). It is probed at load like the other native kernels; where it
is not usable the rows take the packed path.

On CPUs without AVX-512 (such as the AMD EPYC above) ``auto`` takes kernels.projections' panel kernel
instead of oneDNN for the rows past the small-row kernel: the weight packed once into 24-feature
panels (in its own dtype: it replaces oneDNN's packed copy), a 4 x 24 register tile of FMAs, the next
panel prefetched, runs of panels claimed by whichever thread is free. Over 30 layers of SmolLM2's
projections, fp32, 2 threads, weights streamed from memory: 1.8x oneDNN at 9-16 rows, 1.45x at 32,
1.15x at 64, even from 128 to 1400 (a prefill). In bf16 it is the GEMM oneDNN lacks there (``F.linear``
in bf16 is torch's reference loop, about 16 GFLOP/s against 100 and more for fp32): bf16 panels
widened in the register, the fp32 sum rounded once (the same values as a bf16 GEMM with an fp32
accumulator, up to the order of the sum), at 32 rows 1.6x oneDNN's fp32 GEMM as it reads half the
bytes. On AVX-512 CPUs sixteen-lane kernels take the fp32 rows instead (the panel kernel's below, or
oneDNN's), and bf16 goes to oneDNN's bf16 path or the dot-product kernel. Without the native build,
the engine logs at load that bf16 runs on the reference GEMM where oneDNN has no bf16 path.

Where the CPU has AVX512-BF16, bf16 projections of every row count take kernels.projections' dot-product
panel kernel instead of oneDNN's bf16 GEMM (and instead of the small-row kernel from two rows on, which
it beats at 2-8 rows there, see :func:`small_rows`): 32-feature panels of input pairs, an 8 x 32 tile of
vdpbf16ps (two exact bf16 products added to each fp32 lane per instruction), the next panel
prefetched. On a 2-core AMD EPYC with AVX512-BF16 (Zen 4), 30 layers of SmolLM2's projections,
isolated: 1.15-1.6x oneDNN at 9-32 rows, 1.1-1.3x at 64, even from 128 on (about 420 GFLOP/s, oneDNN's
own 2048^3 rate); in the engine, a batch-32 bf16 decode step's projections 31.1 -> 19.2 ms and the
step 50.2 -> 33.2 ms (``python -m bench.engine_step --quick --dtype bfloat16``). It replaces oneDNN's
packed copy, so the weights are still held twice at most.

Where the CPU has AVX-512, fp32 rows past the small-row kernel take kernels.projections' sixteen-lane
panel kernel instead of oneDNN's fp32 GEMM: 32-feature panels, an 8 x 32 tile of 16-lane FMAs, the
dot-product kernel's threads and prefetch. On the same Zen 4, 30 layers of SmolLM2's projections,
isolated: 1.2-1.3x oneDNN at 9-32 rows, 1.14x at 64, even from 512 on; in the engine a batch-32 fp32
decode step's projections 53.6 / 48.1 -> 41.5 / 37.5 ms, the step 80.6 / 73.8 -> 67.7 / 59.5 ms (two
paired runs). On a 2-core Intel Xeon (full-width AVX-512) the same comparison gave the panel kernel
0.84x oneDNN's time at one row and 0.76-0.85x at 8-64 rows, so it stands there too.

Where the CPU has AMX (that Xeon), oneDNN's bf16 GEMM runs on its tiles and the dot-product kernel is
no match past a few rows: over the 121 projections with lm_head, weights streamed from memory, the
panel took 1.0x oneDNN's time at 8 rows, 1.5x at 16, 2.1x at 32, 3.7x at 64 and 5.0x at 128 (every
prefill). So ``auto`` in bf16 on AMX packs for oneDNN, and the small-row kernel keeps up to
AMX_SMALL_ROWS (7) rows, where it took 0.76-0.97x oneDNN's time (the panel kernel 0.73-0.91x: holding
a third copy of the weights for it was not worth the difference). The native layer loop calls
oneDNN's op itself, the rows padded as here.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import structlog
import torch
import torch.nn.functional as F

from kernels import native, projections
from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.prequant import PackedLinear
from services.worker.engine.quant import QuantWeight, WeightFormat, quantize

CpuLinear = Literal["auto", "torch", "onednn", "panel"]
PanelKernel = Literal["eight", "wide", "dot"]  # kernels.projections' panel_linear, _wide, _dot
# How a projection runs its rows past the small-row kernel: a panel kernel, oneDNN's packed weight, F.linear;
# or a quantized weight's (quant.py) for all its rows
LinearPath = PanelKernel | Literal["onednn", "torch", "int8", "int4"]
PANEL_KERNELS: tuple[PanelKernel, ...] = ("eight", "wide", "dot")
log = structlog.get_logger("engine")
BF16_WIDENING_ROWS = 4  # bf16 rows the kernel takes without AVX512-BF16's dot product
PANEL_SMALL_ROWS = 4  # rows the small-row kernel keeps where an fp32-rate panel kernel takes the rest
DOT_SMALL_ROWS = 1  # and where the bf16 dot-product panel kernel does
AMX_SMALL_ROWS = 7  # and where oneDNN's bf16 GEMM on AMX tiles does


def small_rows(dtype: torch.dtype, path: LinearPath) -> int:
    """Rows up to which ``auto`` takes kernels.projections' small-row kernel rather than ``path``, the one
    for more rows (0: none), where it was faster over 30 layers of SmolLM2's projections (weights streamed
    from memory, 2 threads). Against oneDNN's packed path: fp32 1.1x at one row,
    1.3-1.5x at 2-4, 1.2x at 8; bf16 1.3x at one row, 1.5-1.8x at 2-4, and at 5-8 only where the build
    has vdpbf16ps (widening the bf16 weights costs more than the pass saves there; where oneDNN has no
    bf16 GEMM, all eight). Against the eight-lane panel kernel (AVX2): even at 1-7 rows (both stream
    the weight at the read bandwidth), 1.0-1.15x at 2-4 in fp32, the panel 1.06-1.2x faster at 8; against
    the sixteen-lane fp32 one on Zen 4 even at 1-4 rows, the panel 1.1-1.2x faster at 5-8: so 4 against
    either. Against the bf16 dot-product panel kernel on Zen 4 the panel is faster from two rows (1.18x
    at two, 1.4-1.65x at 3-8: it streams each contiguous panel, where the small-row kernel reads rows of
    the plain weight side by side): 1. Since the panel kernels fetch two lines a step in a one-tile
    panel, their 121 projections take 0.91-0.97x the small-row kernel's time at 1-4 fp32 rows and
    0.98x at one bf16 row, but whole decode steps were even (alternating processes, 3 rounds: fp32
    batch 1 22.4 vs 22.6 ms, batch 2 23.1 vs 23.6, batch 4 24.8 vs 24.0; bf16 batch 1 12.7 vs 11.5,
    rounds spread 11.2-12.8), within the noise, so both thresholds stand. Call only where
    ``native_small_linear()`` is True."""
    if dtype not in (torch.float32, torch.bfloat16):
        return 0
    if path == "dot":
        return DOT_SMALL_ROWS
    if path in PANEL_KERNELS:
        return PANEL_SMALL_ROWS
    if path == "onednn" and onednn_amx(dtype):
        return AMX_SMALL_ROWS
    if dtype == torch.float32 or path == "torch" or projections.small_linear_dot_bf16():
        return projections.SMALL_LINEAR_ROWS  # (bf16 on the torch path: the alternative is its reference GEMM)
    return BF16_WIDENING_ROWS


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


@functools.cache
def onednn_usable(dtype: torch.dtype) -> bool:
    """Whether prepacked oneDNN linears work here for ``dtype`` and agree with ``F.linear``: fp32, and
    bf16 where oneDNN has a bf16 path on this CPU (AVX-512 BF16 or AMX natively, AVX-512BW emulated).
    Probed once per dtype."""
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


def onednn_amx(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is bf16 and oneDNN's bf16 GEMM runs on this CPU's AMX tiles, where ``auto``
    takes it past AMX_SMALL_ROWS rows (the dot-product panel kernel is 1.5-5x slower there)."""
    return dtype == torch.bfloat16 and projections.amx_bf16() and onednn_usable(dtype)


# Each path's layout of the weight, made once at load (Linear.prepared).
PREPARE: dict[LinearPath, Callable[[torch.Tensor], torch.Tensor]] = {
    "eight": projections.panel_pack,
    "wide": projections.panel_pack_wide,
    "dot": projections.panel_pack_dot,
    "onednn": _pack,
}


@dataclass(slots=True)
class Linear:
    """``y = x @ weight.T + bias``: up to ``small_rows`` rows through kernels.projections' small-row
    kernel, the rest by ``path``: a panel kernel or oneDNN on ``prepared``, the weight in that path's
    layout (so never both copies besides the plain weight), or ``F.linear`` on the plain weight. With
    ``quant`` (paths int8 and int4) every row runs on the quantized weight, and ``weight`` is a meta
    tensor holding only the logical shape."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None
    path: LinearPath = "torch"
    prepared: torch.Tensor | None = None  # None exactly on the torch and quantized paths
    small_rows: int = 0  # 0: no small-row kernel
    quant: QuantWeight | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return self.quant(x, self.bias)
        if x.shape[0] <= self.small_rows and x.shape[0] > 0:
            return projections.small_linear(x if x.stride(-1) == 1 else x.contiguous(), self.weight, self.bias)
        prepared = self.prepared
        if prepared is None:
            return F.linear(x, self.weight, self.bias)
        if self.path == "onednn":
            return _packed_linear(x, prepared, self.bias)
        features = self.weight.shape[0]
        if self.path == "wide":
            return projections.panel_linear_wide(x, prepared, self.bias, features)
        if self.path == "dot":
            return projections.panel_linear_dot(x, prepared, self.bias, features)
        return projections.panel_linear(x, prepared, self.bias, features)


class LinearFactory:
    """Builds every projection of one model under one policy (probed once): ``auto`` (the small-row
    kernel for a small batch; past it the panel kernel this CPU does best, where it has one: the dot
    product for bf16 with AVX512-BF16 but no AMX (with AMX, oneDNN's tile GEMM), sixteen lanes for fp32 with AVX-512, eight lanes without
    AVX-512 or where it is the only bf16 GEMM; else oneDNN's packed path where usable, else
    ``F.linear``), ``torch`` (``F.linear`` only), ``onednn`` / ``panel`` (that path for every row
    count, refusing to start where it is not usable). With ``weights`` int8 or int4 every projection is
    quantized (quant.py) whatever the mode, CPU fp32 and bf16 only (UnsupportedQuantization elsewhere)."""

    def __init__(
        self, mode: CpuLinear, device: str, dtype: torch.dtype, weights: WeightFormat = "none", group_size: int = 32
    ):
        self.weights, self.group_size, self.dtype, self.device = weights, group_size, dtype, device
        if weights != "none" and (torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16)):
            raise UnsupportedQuantization(
                f"LF_ENGINE__WEIGHTS={weights} serves the CPU engine in float32 or bfloat16, not {device} {dtype}"
            )
        cpu, panels = torch.device(device).type == "cpu", mode in ("auto", "panel")
        eight = cpu and panels and dtype in native.DTYPES and projections.native_panel_linear()
        reference_bf16 = cpu and dtype == torch.bfloat16 and not onednn_usable(dtype)
        amx = cpu and mode == "auto" and onednn_amx(dtype)
        self.path: LinearPath = "torch"
        if cpu and panels and dtype == torch.bfloat16 and projections.native_panel_dot() and not amx:
            self.path = "dot"  # at every row count past the small ones
        elif cpu and panels and dtype == torch.float32 and projections.native_panel_wide():
            self.path = "wide"
        elif eight and (mode == "panel" or projections.panel_linear_preferred() or reference_bf16):
            self.path = "eight"
        elif cpu and mode in ("auto", "onednn") and onednn_usable(dtype):
            self.path = "onednn"
        if mode == "panel" and self.path not in PANEL_KERNELS:
            raise ValueError(f"cpu_linear='panel' is not usable here for {dtype} (see the engine log)")
        if mode == "onednn" and self.path != "onednn":
            raise ValueError(f"cpu_linear='onednn' is not usable here for {dtype} (see the engine log)")
        auto = mode == "auto" and cpu
        self.small_rows = small_rows(dtype, self.path) if auto and projections.native_small_linear() else 0
        if self.path in PANEL_KERNELS:
            log.info("panel_linear", dtype=str(dtype), small_rows=self.small_rows, cpu_linear=mode, kernel=self.path)
        elif amx:
            log.info("onednn_amx_linear", dtype=str(dtype), small_rows=self.small_rows, cpu_linear=mode)
        elif reference_bf16 and mode != "torch":
            log.warning(
                "bf16_linear_reference_gemm",
                detail="no oneDNN bf16 GEMM on this CPU and no native panel kernel: bf16 projections past "
                f"{self.small_rows} rows run torch's reference GEMM, several times slower than fp32",
                cpu_linear=mode,
            )

    def head(self, weight: torch.Tensor, packed: PackedLinear | None = None) -> Linear:
        """The lm_head: as a projection, except that int4 weights keep it in int8 (as llama.cpp's 4-bit
        types keep their output matrix at 6 bits or more): on SmolLM2, int4 there cost the greedy
        agreement with bf16 more than every int4 layer together."""
        return self(weight, weights="int8" if self.weights == "int4" else self.weights, packed=packed)

    def __call__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        weights: WeightFormat | None = None,
        packed: PackedLinear | None = None,
    ) -> Linear:
        """A projection of ``weight`` [out, in]; with ``packed`` (a pre-quantized checkpoint's, ``weight``
        then a meta tensor of its logical shape) it runs on those codes whatever ``weights`` says."""
        if packed is not None:
            if torch.device(self.device).type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16):
                raise UnsupportedQuantization(
                    f"a pre-quantized checkpoint serves the CPU engine in float32 or bfloat16, not {self.device} "
                    f"{self.dtype}"
                )
            quant = packed.quant(self.dtype)
            bias = bias.contiguous() if bias is not None else None
            return Linear(
                torch.empty(weight.shape, dtype=self.dtype, device="meta"), bias, quant.format, None, 0, quant
            )
        weights = weights or self.weights
        if weights != "none":
            quant = quantize(weight, weights, self.group_size, self.dtype)
            logical = torch.empty(weight.shape, dtype=self.dtype, device="meta")
            bias = bias.contiguous() if bias is not None else None
            return Linear(logical, bias, weights, None, 0, quant)
        prepared = PREPARE[self.path](weight) if self.path != "torch" else None
        weight, bias = weight.contiguous(), bias.contiguous() if bias is not None else None
        return Linear(weight, bias, self.path, prepared, self.small_rows)
