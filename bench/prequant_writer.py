"""Writers of pre-quantized checkpoints in the published formats (GPTQ v1, AWQ GEMM, compressed-tensors
pack-quantized / int-quantized / naive-quantized), for bench.quant and the tests: gptqmodel/auto-gptq and
autoawq need CUDA builds, and compressed-tensors is not in the project's environment
(tests/worker/engine/test_prequant.py checks this writer against its compressor where it is importable).

Each writer rewrites a directory that already holds ``model`` saved with ``save_pretrained``: every
projection of the decoder layers is quantized (lm_head stays plain, as the formats' own tools leave it)
with a plain min/max rule (no calibration: the format is what is exercised, not the quantizer), and the
dequantized weights ``(q - z) * s`` in fp32 come back by module name: the reference a transformers
forward takes (tests/helpers/prequant.py ``with_weights``). A mixture-of-experts model's experts are
quantized one module per expert and projection under the names ``save_pretrained`` writes them
(``mlp.experts.E.gate_proj``, Mixtral's ``block_sparse_moe.experts.E.w1``), as GPTQ and AWQ checkpoints of
these families hold them; the router and Qwen2-MoE's shared-expert gate stay plain, as those tools leave them.
"""

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble k of a word holds column 8c + this[k]
SAVED_EXPERT = re.compile(r"^(.*\.experts\.\d+\.\w+)\.weight$")  # one expert's projection as save_pretrained writes it
ROUTERS = ("mlp.gate", "block_sparse_moe.gate", "shared_expert_gate")  # left plain (on-disk names)


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 bits -> int32 (two's complement)."""
    return ((values + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[rows, 8n] of 0-15 -> int32 [rows, n], element 8c + k in nibble k of word c."""
    words = q.to(torch.int64).view(q.shape[0], -1, 8) << torch.arange(0, 32, 4)
    return _int32(words.sum(-1))


def int4_groups(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> codes [out, in] 0-15, scales [out, groups] fp16, zeros [out, groups] 1-15 (GPTQ's rule)."""
    g = w.float().view(w.shape[0], -1, group)
    high, low = g.amax(-1).clamp(min=0), g.amin(-1).clamp(max=0)
    if symmetric:
        high = torch.maximum(high, -low)
        low = -high
    scales = ((high - low) / 15).clamp(min=1e-6).half()
    zeros = torch.full_like(scales, 8.0) if symmetric else torch.round(-low / scales.float()).clamp(1, 15)
    codes = torch.round(g / scales.float()[..., None] + zeros[..., None]).clamp(0, 15)
    return codes.view(w.shape).to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantized(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    q = codes.float().view(codes.shape[0], -1, group) - zeros.float()[..., None]
    return (q * scales.float()[..., None]).view(codes.shape)


def _projections(model: PreTrainedModel, directory: Path) -> dict[str, torch.Tensor]:
    """Every projection to quantize by module name, with its weight [out, in]: the decoder layers' linears
    but the routers, and each expert's projections as saved in ``directory``."""
    found = {
        n: m.weight.detach()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in n and not n.endswith(ROUTERS)
    }
    for file in sorted(directory.glob("*.safetensors")):
        found |= {match[1]: w for key, w in load_file(file).items() if (match := SAVED_EXPERT.match(key))}
    return found


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state |= load_file(file)
        file.unlink()
    for name in {k.rsplit(".", 1)[0] for k in tensors}:
        state.pop(f"{name}.weight", None)
    save_file({**state, **tensors}, directory / "model.safetensors", metadata={"format": "pt"})
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": config}, indent=2))


def write_gptq(
    model: PreTrainedModel, directory: Path, group: int, symmetric: bool, checkpoint_format: str = "gptq"
) -> dict[str, torch.Tensor]:
    """GPTQ: qweight int32 [in / 8, out] packed along the input, qzeros int32 [groups, out / 8] holding
    z - 1 (checkpoint_format gptq, v1) or z (gptq_v2, as gptqmodel saves it), scales fp16 [groups, out],
    g_idx [in]."""
    tensors, weights = {}, {}
    for name, w in _projections(model, directory).items():
        codes, scales, zeros = int4_groups(w, group, symmetric)
        weights[name] = dequantized(codes, scales, zeros, group)
        tensors[f"{name}.qweight"] = pack_nibbles(codes).T.contiguous()  # word [r, j]: inputs 8r..8r+7 of j
        stored = zeros.T.to(torch.int64) - (1 if checkpoint_format == "gptq" else 0)
        tensors[f"{name}.qzeros"] = pack_nibbles(stored.contiguous())
        tensors[f"{name}.scales"] = scales.T.contiguous()
        tensors[f"{name}.g_idx"] = (torch.arange(w.shape[1]) // group).to(torch.int32)
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": symmetric}
    _write(directory, tensors, {**config, "checkpoint_format": checkpoint_format, "static_groups": False})
    return weights


def write_awq(model: PreTrainedModel, directory: Path, group: int) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], output 8c + AWQ_PACK_ORDER[k]
    in nibble k of word c; scales fp16 [groups, out]; zero points always."""
    order = list(AWQ_PACK_ORDER)
    tensors, weights = {}, {}
    for name, w in _projections(model, directory).items():
        codes, scales, zeros = int4_groups(w, group, symmetric=False)
        weights[name] = dequantized(codes, scales, zeros, group)

        def awq_pack(columns: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]
            return pack_nibbles(columns.view(columns.shape[0], -1, 8)[:, :, order].reshape(columns.shape))

        tensors[f"{name}.qweight"] = awq_pack(codes.T.contiguous())
        tensors[f"{name}.qzeros"] = awq_pack(zeros.T.contiguous())
        tensors[f"{name}.scales"] = scales.T.contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _write(directory, tensors, config)
    return weights


def ct_quantize(
    w: torch.Tensor, bits: int, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """compressed-tensors' signed codes: int8 per channel (symmetric) or int4 per group; (q int8 [out, in],
    scale [out, groups] fp32, zero point int8 [out, groups] or None)."""
    if bits == 8:
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=1e-6)
        return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale, None
    codes, scales, zeros = int4_groups(w, group, symmetric)
    q = (codes.to(torch.int16) - 8).to(torch.int8)
    zero_point = None if symmetric else (zeros.to(torch.int16) - 8).to(torch.int8)
    return q, scales.float(), zero_point


def ct_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """pack-quantized: element i of a row at bit i * bits, stored q + 2^(bits - 1)."""
    unsigned = q.to(torch.int64) + (1 << (bits - 1))
    if bits == 4:
        return pack_nibbles(unsigned)
    words = unsigned.view(q.shape[0], -1, 4) << torch.arange(0, 32, 8)
    return _int32(words.sum(-1))


def write_compressed_tensors(
    model: PreTrainedModel, directory: Path, fmt: str, bits: int, group: int = 32, symmetric: bool = True
) -> dict[str, torch.Tensor]:
    """A weight-only compressed-tensors checkpoint as llm-compressor saves it (``fmt`` pack-quantized,
    int-quantized or naive-quantized; int8 channel-wise or int4 group-wise)."""
    tensors, weights = {}, {}
    for name, weight in _projections(model, directory).items():
        w = weight.float()
        q, scale, zero_point = ct_quantize(w, bits, group, symmetric)
        zp = zero_point.float() if zero_point is not None else torch.zeros_like(scale)
        width = w.shape[1] if bits == 8 else group
        deq = (q.float().view(w.shape[0], -1, width) - zp[..., None]) * scale[..., None]
        weights[name] = deq.view(w.shape)
        if fmt == "pack-quantized":
            tensors[f"{name}.weight_packed"] = ct_pack(q, bits)
            tensors[f"{name}.weight_shape"] = torch.tensor(list(w.shape))
            if zero_point is not None:
                tensors[f"{name}.weight_zero_point"] = ct_pack(zero_point.T.contiguous(), bits).T.contiguous()
        else:
            tensors[f"{name}.weight"] = q
            if zero_point is not None:
                tensors[f"{name}.weight_zero_point"] = zero_point
        tensors[f"{name}.weight_scale"] = scale
    args = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False, "actorder": None}
    args |= {"strategy": "channel", "group_size": None} if bits == 8 else {"strategy": "group", "group_size": group}
    config = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head", *(f"re:.*{router}$" for router in ROUTERS)],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": args, "input_activations": None, "output_activations": None}
        },
    }
    _write(directory, tensors, config)
    return weights
