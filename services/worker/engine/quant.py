"""Weight-only quantized projections (``LF_ENGINE__WEIGHTS``): int8 per output channel, int4 per group
of ``LF_ENGINE__WEIGHT_GROUP_SIZE`` input features, both symmetric, quantized once at load from the
model's fp32 or bf16 weights. Activations, biases, norms, the embedding, the K/V cache and LoRA deltas
stay in the engine's dtype; a projection's values are ``x @ dequantize(w).T + bias`` in that dtype.

    int8: q = round(w / s).clamp(-127, 127), s = max|w[row]| / 127           w' = q * s
    int4: q = round(w / s).clamp(-7, 7),     s = max|w[row, group]| / 7      w' = q * s

int8 up to eight rows (a decode step's) runs the native small-row kernel ``small_linear_int8``
(kernels/csrc/small_gemm_int8.cpp, fp32 or bf16 rows): the codes streamed once for all the rows, each
sixteen widened to fp32 in registers, fp32 sums scaled once per output feature. At batch 1 on SmolLM2
(2 threads, the shared 2-core box, the engine stepped on the thread that built it) a bf16 decode step
took 15-18 ms through torch's ``aten._weight_int8pack_mm`` and 7-10 ms through it, the codes' pass near
the read bandwidth (its 121 projections and lm_head about 5.8 ms of a step against a 5.2 ms floor), and
an fp32 one (which dequantized every weight per call before) about 10 ms; the native layer loop
(layer_loop.py) takes int8 models too. int4 with fp32 activations likewise runs up to eight rows through
``small_linear_int4`` (kernels/csrc/small_gemm_int4.cpp, groups a multiple of 32: each group's fp32 sum
of x * (q - z) scaled once), where it used to dequantize every weight per call (SmolLM2 at batch 1:
201 -> 5.1 ms a token). With bf16 activations torch's int4 kernel was faster at one row than that one
(SmolLM2's 120 layer projections 2.3-2.7 against 3.4-4.0 ms), so it keeps every row count there; the
native layer loop takes int4 models in both dtypes. Past eight rows, and for bf16 int4, torch's own CPU kernels,
``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu`` (the weight in its blocked int4
layout), which accumulate in fp32. Both are vectorised for bf16 activations only: with fp32 ones they
took 5-27x (int8, 1-8 rows) and 16-120x (int4, 1-64 rows) F.linear's time on SmolLM2's gate_up
projection (one thread, Zen 4, a machine shared with other jobs). So past the small rows in fp32 every
call dequantizes the weight into fp32 and runs F.linear (the values the reference forward has), and in
bf16 torch's kernels take the rows: int8 up to INT8_KERNEL_ROWS rows (past them dequantizing per call
was faster: 256 rows 35 -> 17 ms), int4 at every row count (even with dequantizing per call at 256
rows, 1.4-7x faster at 4-64 rows, and it holds no unpacked copy to dequantize from).

A pre-quantized checkpoint (prequant.py) arrives as codes, scales and zero points: ``from_codes`` takes
them as they are. Its int4 groups may be asymmetric, ``w' = (q - z) * s`` with z in 0-16 per group
(``zeros``; None is the engine's own z = 8): fp32 dequantizes exactly that, and torch's bf16 kernel,
which computes ``(q - 8) * s + zero``, takes ``zero = (8 - z) * s`` rounded to bf16.

The unquantized weights stay in memory (the transformers model and ModelWeights hold them): a step reads
only the quantized ones, so this saves bandwidth per token, not resident memory.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kernels import projections
from services.worker.engine.errors import UnsupportedQuantization

WeightFormat = Literal["none", "int8", "int4"]
GroupSize = Literal[32, 64, 128]
INT8_KERNEL_ROWS = 64
INT4_PACK_ROWS = 16  # torch's int4 layout packs 16 output features together


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """One projection's quantized weight; ``x -> x @ dequantize().T + bias``."""

    format: Literal["int8", "int4"]
    out_features: int
    in_features: int
    group_size: int  # int4: input features per scale; int8: in_features
    codes: torch.Tensor | None  # int8: [out, in] int8; int4 (fp32): [out, in / 2] uint8, even features low
    scales: torch.Tensor  # int8: [out]; int4: [out, in / group_size]; in the activation dtype
    packed: torch.Tensor | None = None  # int4 (bf16): torch's blocked int4 layout of the codes
    scale_zeros: torch.Tensor | None = None  # int4 (bf16): [in / group_size, out, 2], (scale, 0) per group
    kernel_rows: int = 0  # rows up to which torch's kernel runs (0: none, dequantize per call)
    zeros: torch.Tensor | None = None  # int4 (fp32), asymmetric checkpoints: [out, in / group_size] uint8 z
    small_rows: int = 0  # rows up to which the native small-row kernel runs (0: none)

    def dequantize(self) -> torch.Tensor:
        """The weight the projection computes with, [out, in] in the activation dtype."""
        dtype = self.scales.dtype
        if self.format == "int8":
            assert self.codes is not None
            return self.codes.to(dtype) * self.scales[:, None]
        assert self.codes is not None, "bf16 int4 weights live in torch's layout only"
        low, high = (self.codes & 0xF).to(torch.int16), (self.codes >> 4).to(torch.int16)
        codes = torch.stack((low, high), dim=-1).view(self.out_features, -1, self.group_size)
        codes = codes - (self.zeros[:, :, None].to(torch.int16) if self.zeros is not None else 8)
        return (codes.to(dtype) * self.scales[:, :, None]).view(self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if 0 < rows <= self.small_rows and self.format == "int4":
            assert self.codes is not None
            return projections.small_linear_int4(
                x if x.stride(-1) == 1 else x.contiguous(), self.codes, self.scales, self.zeros, bias, self.group_size
            )
        if self.format == "int4" and self.packed is not None:
            out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.packed, self.group_size, self.scale_zeros
            )
        elif 0 < rows <= self.small_rows:
            assert self.codes is not None
            return projections.small_linear_int8(
                x if x.stride(-1) == 1 else x.contiguous(), self.codes, self.scales, bias
            )
        elif 0 < rows <= self.kernel_rows:
            out = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.codes, self.scales)
        else:
            return F.linear(x, self.dequantize(), bias)
        return out.add_(bias) if bias is not None else out


def quantize(weight: torch.Tensor, format: Literal["int8", "int4"], group_size: int, dtype: torch.dtype) -> QuantWeight:
    """Quantize ``weight`` [out, in] (any float dtype, read in fp32) for activations of ``dtype``
    (fp32 or bf16); UnsupportedQuantization where the shape does not fit the format."""
    out_features, in_features = weight.shape
    w = weight.detach().float()
    if format == "int8":
        scales = _scales(w.abs().amax(dim=1), 127).to(dtype)
        codes = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return _int8(codes, scales, dtype)
    _check_int4(out_features, in_features, group_size)
    groups = w.view(out_features, in_features // group_size, group_size)
    scales = _scales(groups.abs().amax(dim=2), 7).to(dtype)  # [out, groups]
    codes = (torch.round(groups / scales.float()[:, :, None]).clamp_(-7, 7) + 8).to(torch.uint8)
    return _int4(pack_nibbles(codes.view(out_features, in_features)), scales, None, group_size, dtype)


def from_codes(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> QuantWeight:
    """A checkpoint's quantized weight as it is, for activations of ``dtype``: int8 ``codes`` [out, in]
    (symmetric, ``scales`` [out]), or int4 ``codes`` [out, in / 2] uint8 (two 0-15 codes a byte, even
    inputs in the low nibble: pack_nibbles) with ``scales`` and ``zeros`` [out, in / group_size] (zeros
    None: 8), ``w' = (q - z) * s``; fp32 keeps those bytes as they are. UnsupportedQuantization where the
    shape does not fit the format."""
    if codes.dtype == torch.int8:
        assert zeros is None and scales.shape == (codes.shape[0],)
        return _int8(codes.contiguous(), scales.to(dtype).contiguous(), dtype)
    _check_int4(codes.shape[0], codes.shape[1] * 2, group_size)
    return _int4(codes, scales.to(dtype), zeros, group_size, dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] uint8 0-15 -> [out, in / 2] uint8, even inputs in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: [out, in / 2] -> [out, in] uint8."""
    return torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(nibbles.shape[0], -1)


def _check_int4(out_features: int, in_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise UnsupportedQuantization(
            f"int4 weights need in_features divisible by the group size: a [{out_features}, {in_features}] "
            f"projection with group size {group_size}"
        )
    if out_features % INT4_PACK_ROWS:
        raise UnsupportedQuantization(
            f"int4 weights need out_features divisible by {INT4_PACK_ROWS} (torch's int4 layout): "
            f"a [{out_features}, {in_features}] projection"
        )


def _int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> QuantWeight:
    """codes [out, in] int8, scales [out] in ``dtype``: the native small-row kernel up to its rows where it
    is built here, torch's bf16 kernel past them (bf16 only), else the weight dequantized per call."""
    out_features, in_features = codes.shape
    kernel_rows = INT8_KERNEL_ROWS if dtype == torch.bfloat16 else 0
    small = projections.SMALL_LINEAR_ROWS if projections.native_small_linear_int8() else 0
    return QuantWeight(
        "int8", out_features, in_features, in_features, codes, scales, kernel_rows=kernel_rows, small_rows=small
    )


def _int4(
    nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> QuantWeight:
    """nibbles [out, in / 2] (pack_nibbles), scales [out, groups] in ``dtype``, zeros [out, groups] (None: 8):
    bf16 rows take torch's kernel (its own layout) at every row count; fp32 ones the native small-row
    kernel up to its rows where it is built here and takes the group size, past them the weight
    dequantized per call (both from the nibbles)."""
    out_features, in_features = nibbles.shape[0], nibbles.shape[1] * 2
    small = (
        projections.SMALL_LINEAR_ROWS
        if dtype == torch.float32
        and group_size % projections.INT4_GROUP_MULTIPLE == 0
        and projections.native_small_linear_int4()
        else 0
    )
    kept = nibbles.contiguous() if dtype != torch.bfloat16 else None  # bf16: torch's layout only
    zero_codes = zeros.to(torch.uint8).contiguous() if zeros is not None and kept is not None else None
    scales = scales.contiguous()
    packed = scale_zeros = None
    if dtype == torch.bfloat16:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles).to(torch.int32), 1)
        offsets = torch.zeros_like(scales) if zeros is None else ((8 - zeros.float()) * scales.float()).to(dtype)
        scale_zeros = torch.stack((scales, offsets), dim=-1).transpose(0, 1).contiguous()
    return QuantWeight(
        "int4", out_features, in_features, group_size, kept, scales, packed, scale_zeros, 0, zero_codes, small
    )


def _scales(amax: torch.Tensor, levels: int) -> torch.Tensor:
    """max|w| / levels, 1 for an all-zero row or group (its codes are 0 whatever the scale)."""
    scales = amax / levels
    return torch.where(scales > 0, scales, torch.ones_like(scales))
