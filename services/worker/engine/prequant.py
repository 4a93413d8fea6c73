"""Pre-quantized checkpoints: a config.json ``quantization_config`` the engine serves, and each packed
projection converted into the codes, scales and zero points of the weight-only kernels (quant.py).

Served, every projection as ``w = (q - z) * s`` per output channel and group of ``group_size`` inputs:

    gptq                int4, desc_act false, group 32/64/128, sym or not; qweight int32 [in / 8, out]
                        (input 8r + k in nibble k of row r), qzeros int32 [groups, out / 8] (output 8c + k
                        in nibble k), scales [groups, out]; checkpoint_format gptq stores z - 1, gptq_v2 z
    awq                 int4, version gemm, zero_point true, group 32/64/128; qweight int32 [in, out / 8]
                        and qzeros [groups, out / 8] with output 8c + AWQ_ORDER[k] in nibble k, scales [groups, out]
    compressed-tensors  weights only (no activation, KV cache, sparsity or transform schemes), int4 groups
                        of 32/64/128 (symmetric or not) or int8 per channel (symmetric); pack-quantized:
                        weight_packed int32 [out, in * bits / 32] (element i at bit i * bits, stored q + 2^(bits-1)),
                        weight_zero_point packed the same way along the output dimension; int-quantized and
                        naive-quantized: weight int8 [out, in] holding q; weight_scale [out, groups]

Anything else is refused in one line (UnsupportedQuantization) naming what is served. The projections
a checkpoint leaves unquantized (lm_head, usually) load as plain weights, and the shapes every other part
of the system checks (LoRA slots, the registry's adapter checks, the fingerprint's architecture) are the
config's logical ones.
"""

from dataclasses import dataclass
from typing import Any, Literal

import torch

from services.worker.engine.errors import UnsupportedQuantization
from services.worker.engine.quant import QuantWeight, from_codes, pack_nibbles, unpack_nibbles

Method = Literal["gptq", "awq", "compressed-tensors"]
GROUP_SIZES = (32, 64, 128)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column (of each 8) that AWQ's GEMM packing puts in nibble k
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
SERVED = (
    "gptq int4 (desc_act=false, group_size 32/64/128), awq int4 (version gemm, zero_point), "
    "compressed-tensors weight-only int4 group 32/64/128 or int8 per-channel symmetric "
    "(pack-quantized, int-quantized, naive-quantized)"
)
# the tensor that marks a projection as quantized, per method (its module name is what precedes it)
MARKERS: dict[Method, tuple[str, ...]] = {
    "gptq": (".qweight",),
    "awq": (".qweight",),
    "compressed-tensors": (".weight_packed", ".weight_scale"),
}


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """What a served ``quantization_config`` says about every quantized projection."""

    method: Method
    bits: Literal[4, 8]
    group_size: int  # inputs per scale; 0: one scale per output channel
    symmetric: bool
    stored_zero_offset: int = 0  # GPTQ v1 stores z - 1
    ct_format: str = ""  # compressed-tensors: how the codes are stored


@dataclass(frozen=True, slots=True)
class PackedLinear:
    """One projection's codes as the weight-only kernels take them (quant.from_codes)."""

    codes: torch.Tensor  # int8 [out, in] (int8), or uint8 [out, in / 2], two 0-15 codes a byte (int4: pack_nibbles)
    scales: torch.Tensor  # [out] (int8) or [out, in / group_size] (int4)
    zeros: torch.Tensor | None  # int4, asymmetric: [out, in / group_size] uint8 z in 0-16
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        widen = 2 if self.codes.dtype == torch.uint8 else 1
        return self.codes.shape[0], self.codes.shape[1] * widen

    def quant(self, dtype: torch.dtype) -> QuantWeight:
        return from_codes(self.codes, self.scales, self.zeros, self.group_size, dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] in fp32: ``(q - z) * s``."""
        if self.codes.dtype == torch.int8:
            return self.codes.float() * self.scales.float()[:, None]
        out, inputs = self.shape
        zeros = self.zeros.float() if self.zeros is not None else torch.full_like(self.scales.float(), 8)
        q = unpack_nibbles(self.codes).float().view(out, -1, self.group_size)
        return ((q - zeros[:, :, None]) * self.scales.float()[:, :, None]).view(out, inputs)


def concat(parts: list[PackedLinear]) -> PackedLinear:
    """Projections fused row-wise (q|k|v, gate|up), as the engine runs them."""
    if len(parts) == 1:
        return parts[0]
    zeros = [p.zeros for p in parts]
    if any(z is None for z in zeros) and not all(z is None for z in zeros):
        raise UnsupportedQuantization("a fused projection mixes symmetric and asymmetric int4 parts")
    return PackedLinear(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([z for z in zeros if z is not None]) if zeros[0] is not None else None,
        parts[0].group_size,
    )


def _refuse(detail: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"quantization_config {detail} is not served (served: {SERVED})", param="model")


def checkpoint_quant(config: Any) -> CheckpointQuant | None:
    """The config's served quantization (None: not quantized), else UnsupportedQuantization in one line."""
    raw = getattr(config, "quantization_config", None)
    if raw is None:
        return None
    qc: dict[str, Any] = raw if isinstance(raw, dict) else raw.to_dict()
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise _refuse(f"quant_method={method!r}")


def _group(method: str, group_size: object) -> int:
    if group_size not in GROUP_SIZES:
        raise _refuse(f"{method} group_size={group_size!r}")
    assert isinstance(group_size, int)
    return group_size


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    if qc.get("bits") != 4:
        raise _refuse(f"gptq bits={qc.get('bits')!r}")
    if qc.get("desc_act"):
        raise _refuse("gptq desc_act=true (act-order g_idx)")
    checkpoint = qc.get("checkpoint_format", "gptq")
    if checkpoint not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format={checkpoint!r}")
    group = _group("gptq", qc.get("group_size"))
    return CheckpointQuant("gptq", 4, group, bool(qc.get("sym", True)), 1 if checkpoint == "gptq" else 0)


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    version = str(qc.get("version", "gemm")).lower()
    if qc.get("bits", qc.get("w_bit")) != 4 or version != "gemm" or not qc.get("zero_point", True):
        raise _refuse(f"awq bits={qc.get('bits')!r} version={version!r} zero_point={qc.get('zero_point')!r}")
    return CheckpointQuant("awq", 4, _group("awq", qc.get("group_size", qc.get("q_group_size"))), False)


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(f"compressed-tensors {key}")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise _refuse(f"compressed-tensors quantization_status={qc.get('quantization_status')!r}")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    schemes = []
    for group in groups:
        fmt = group.get("format") or fmt
        if group.get("input_activations") or group.get("output_activations"):
            raise _refuse("compressed-tensors activation quantization")
        schemes.append((fmt, tuple(sorted((k, str(v)) for k, v in (group.get("weights") or {}).items()))))
    if len(set(schemes)) != 1:
        raise _refuse("compressed-tensors with more than one weight scheme")
    weights: dict[str, Any] = groups[0].get("weights") or {}
    if fmt not in CT_FORMATS:
        raise _refuse(f"compressed-tensors format={fmt!r}")
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    symmetric = bool(weights.get("symmetric", True))
    if weights.get("actorder") or weights.get("dynamic"):
        raise _refuse(f"compressed-tensors actorder={weights.get('actorder')!r} dynamic={weights.get('dynamic')!r}")
    if kind == "int" and bits == 8 and strategy == "channel" and symmetric:
        return CheckpointQuant("compressed-tensors", 8, 0, True, ct_format=str(fmt))
    if kind == "int" and bits == 4 and strategy == "group":
        return CheckpointQuant(
            "compressed-tensors",
            4,
            _group("compressed-tensors", weights.get("group_size")),
            symmetric,
            ct_format=str(fmt),
        )
    raise _refuse(
        f"compressed-tensors weights type={kind!r} num_bits={bits!r} strategy={strategy!r} symmetric={symmetric}"
    )


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> [..., n * 8] int16, nibble k of each word at position 8 * word + k."""
    data = packed.contiguous().view(torch.uint8)  # little-endian: nibble k of a word is byte k // 2's, low first
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2).to(torch.int16)


def quantized_modules(quant: CheckpointQuant, names: list[str]) -> list[str]:
    """The module names whose tensors mark them quantized in a checkpoint with these tensor ``names``."""
    found = {n[: -len(m)] for n in names for m in MARKERS[quant.method] if n.endswith(m)}
    return sorted(found)


def read_linear(quant: CheckpointQuant, tensors: dict[str, torch.Tensor], module: str) -> PackedLinear:
    """Pop ``module``'s quantized tensors from ``tensors`` and convert them."""

    def take(suffix: str) -> torch.Tensor:
        return tensors.pop(f"{module}.{suffix}")

    if quant.method == "compressed-tensors":
        return _read_ct(quant, tensors, module)
    qweight, qzeros, scales = take("qweight"), take("qzeros"), take("scales").float()
    if quant.method == "gptq":
        g_idx = tensors.pop(f"{module}.g_idx", None)
        codes = _nibbles(qweight.T).contiguous()  # [out, in]
        zeros = _nibbles(qzeros) + quant.stored_zero_offset  # [groups, out]
        inputs = codes.shape[1]
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(inputs) // quant.group_size):
            raise _refuse(f"gptq g_idx reordering ({module})")
    else:
        order = torch.tensor(AWQ_ORDER)
        inverse = torch.argsort(order)  # column k of each 8 sits in nibble inverse[k]

        def columns(packed: torch.Tensor) -> torch.Tensor:
            n = _nibbles(packed).view(packed.shape[0], -1, 8)
            return n[:, :, inverse].flatten(1)

        codes = columns(qweight).T.contiguous()  # [out, in]
        zeros = columns(qzeros)
    group_zeros = zeros.T.contiguous()  # [out, groups]
    symmetric = quant.symmetric and bool((group_zeros == 8).all())
    zero_codes = None if symmetric else group_zeros.to(torch.uint8)
    return PackedLinear(pack_nibbles(codes.to(torch.uint8)), scales.T.contiguous(), zero_codes, quant.group_size)


def _read_ct(quant: CheckpointQuant, tensors: dict[str, torch.Tensor], module: str) -> PackedLinear:
    scales = tensors.pop(f"{module}.weight_scale").float()  # [out, groups] ([out, 1] per channel)
    zero_point = tensors.pop(f"{module}.weight_zero_point", None)
    offset = 1 << (quant.bits - 1)
    if quant.ct_format == "pack-quantized":
        packed = tensors.pop(f"{module}.weight_packed")
        out, inputs = (int(d) for d in tensors.pop(f"{module}.weight_shape").tolist())
        if quant.bits == 4:
            codes = _nibbles(packed)[:, :inputs]
        else:
            codes = packed.contiguous().view(torch.uint8).view(out, -1)[:, :inputs].to(torch.int16)
        q = codes - offset  # signed codes
        if zero_point is not None:
            zero_point = _nibbles(zero_point.T.contiguous())[:, :out].T - offset  # [out, groups]
    else:
        q = tensors.pop(f"{module}.weight").to(torch.int16)
    if quant.bits == 8:
        if zero_point is not None and bool(zero_point.any()):
            raise _refuse(f"compressed-tensors asymmetric int8 ({module})")
        return PackedLinear(q.to(torch.int8).contiguous(), scales.view(-1), None, 0)
    zeros = None if zero_point is None else (zero_point.to(torch.int16) + offset).to(torch.uint8)
    return PackedLinear(pack_nibbles((q + offset).to(torch.uint8)), scales, zeros, quant.group_size)


def checked(linear: PackedLinear, module: str) -> PackedLinear:
    """``linear`` where its scales and zeros have the shape its codes and group size imply."""
    out, inputs = linear.shape
    groups = (out,) if linear.group_size == 0 else (out, inputs // max(linear.group_size, 1))
    if tuple(linear.scales.shape) != groups or (linear.zeros is not None and tuple(linear.zeros.shape) != groups):
        raise UnsupportedQuantization(
            f"{module}: scales {list(linear.scales.shape)} do not fit codes [{out}, {inputs}] in groups of "
            f"{linear.group_size or inputs}",
            param="model",
        )
    return linear
