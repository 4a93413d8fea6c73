"""Test-only pieces for pre-quantized checkpoints: a checkpoint written by compressed-tensors' own
compressor (where the library is importable), and the dequantized reference model. The format writers
themselves are bench/prequant_writer.py (bench.quant uses them too)."""

from pathlib import Path

import torch
from transformers import PreTrainedModel

from tests.helpers.families import save_family


def with_weights(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    """``model`` (changed in place) whose named projections hold ``weights``: the dequantized reference."""
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(w)
    return model


def write_with_compressed_tensors(
    model: PreTrainedModel, directory: Path, fmt: str, bits: int, symmetric: bool
) -> dict[str, torch.Tensor]:
    """The checkpoint written by compressed-tensors' own ModelCompressor (min/max scales from its
    calculate_qparams), and the weights its own decompression gives back, by module name. Needs the
    library importable (it is not in the project's environment)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    strategy = {"strategy": "channel", "group_size": None} if bits == 8 else {"strategy": "group", "group_size": 32}
    args = QuantizationArgs(num_bits=bits, symmetric=symmetric, **strategy)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.detach()
            groups = w if bits == 8 else w.view(w.shape[0], -1, 32)
            scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            module.weight_scale.data = scale.view(module.weight_scale.shape).to(module.weight_scale.dtype)
            if hasattr(module, "weight_zero_point"):
                zp = module.weight_zero_point
                zp.data = zero_point.view(zp.shape).to(zp.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    save_family(model, directory)
    compressor.update_config(str(directory))
    compressor.decompress_model(model)
    return {
        name: m.weight.detach().float().clone()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in name
    }
