"""Adapters on fused projections (Phi-3's qkv_proj and gate_up_proj) split exactly into per-module ones.

A LoRA on a fused projection computes ``x A B`` over the fused output columns; the slice of it for
one module is ``x A B[:, cols]``, so each module gets the shared A and its columns of B.
"""

import re
from typing import Any

import torch

from services.worker.lora.layout import ModelShapes
from shared.errors import IntegrityError
from shared.lora_targets import module_name

FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_FUSED_KEY = re.compile(r"^(.*\.)(qkv_proj|gate_up_proj)(\.lora_([AB])\.weight)$")


def split_fused(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], shapes: ModelShapes
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The adapter's config and tensors with every fused module replaced by its parts; unchanged if none."""
    targets = config.get("target_modules")
    if isinstance(targets, list) and any(module_name(t) in FUSED for t in targets):
        split = [part for t in targets for part in _split_entry(t)]
        config = {**config, "target_modules": split}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = _FUSED_KEY.match(key)
        if match is None:
            out[key] = tensor
            continue
        prefix, fused, suffix, side = match[1], match[2], match[3], match[4]
        parts = FUSED[fused]
        if side == "A":
            for part in parts:
                out[f"{prefix}{part}{suffix}"] = tensor
            continue
        widths = [shapes.dims[part][1] for part in parts]
        if tensor.dim() != 2 or tensor.shape[0] != sum(widths):
            raise IntegrityError(
                f"{key} has shape {tuple(tensor.shape)}, expected {sum(widths)} rows ({' + '.join(parts)})", param=key
            )
        for part, rows in zip(parts, torch.split(tensor, widths), strict=True):
            out[f"{prefix}{part}{suffix}"] = rows
    return config, out


def _split_entry(entry: str) -> tuple[str, ...]:
    """A target_modules entry naming a fused module as its parts, its path kept (``self_attn.qkv_proj`` ->
    ``self_attn.q_proj``, ...); any other entry unchanged."""
    leaf = module_name(entry)
    prefix = entry[: len(entry) - len(leaf)]
    return tuple(prefix + part for part in FUSED[leaf]) if leaf in FUSED else (entry,)
