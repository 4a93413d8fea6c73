"""Test-only pieces for pre-quantized checkpoints: a checkpoint written by compressed-tensors' own
compressor (where the library is importable), and the dequantized reference model. The format writers
themselves are bench/prequant_writer.py (bench.quant uses them too)."""

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from tests.helpers.families import save_family

if TYPE_CHECKING:
    from services.worker.engine import LLMEngine

# one expert's projection as a checkpoint names it -> (its layer's prefix, expert, projection)
EXPERT = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")


def with_weights(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> PreTrainedModel:
    """``model`` (changed in place) whose named projections hold ``weights``: the dequantized reference.
    An expert's projection (``mlp.experts.E.gate_proj``, Mixtral's ``block_sparse_moe.experts.E.w1``) goes
    into its rows of transformers' fused expert tensors."""
    with torch.no_grad():
        for name, w in weights.items():
            match = EXPERT.match(name)
            if match is None:
                model.get_submodule(name).weight.copy_(w)
                continue
            experts = model.get_submodule(f"{match[1]}.mlp.experts")
            expert, inter = int(match[2]), experts.gate_up_proj.shape[1] // 2
            if match[3] in ("gate_proj", "w1"):
                experts.gate_up_proj[expert, :inter].copy_(w)
            elif match[3] in ("up_proj", "w3"):
                experts.gate_up_proj[expert, inter:].copy_(w)
            else:
                experts.down_proj[expert].copy_(w)
    return model


def prompt_logits(engine: "LLMEngine", prompt: list[int]) -> torch.Tensor:
    """Every position's logits: the prompt's prompt_logprobs would give only the top ones, so the forward runs
    over the whole prompt with a fresh KV cache."""
    from services.worker.engine.batch import build_batch
    from services.worker.engine.kv_cache import BlockManager, KVCache
    from services.worker.engine.sequence import EngineRequest, Sequence

    block = 4
    cache = KVCache(engine.model.spec, 64, block, torch.float32, "cpu")
    blocks = BlockManager(64, block)
    seq = Sequence(EngineRequest("p", prompt), None)  # type: ignore[arg-type]
    blocks.allocate(seq)
    batch = build_batch([], [seq], block, "cpu")
    indices = torch.arange(batch.input_ids.shape[0])
    return engine.model.forward(batch.input_ids, batch.positions, batch.meta, cache, indices)


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
