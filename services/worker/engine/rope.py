"""Rotary position embedding tables from a Llama-family config (default, linear, llama3, dynamic)."""

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "dynamic")


def rope_parameters(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope settings, whether the config uses transformers 5 `rope_parameters` or 4.x attributes;
    ``layer_type`` picks one where they are given per layer type (Gemma 3)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params or "sliding_attention" in params:
        params = dict(params.get(layer_type) or {})
    legacy = getattr(config, "rope_scaling", None)
    if legacy and not params.get("rope_type"):
        params.update(legacy)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10_000.0)
    return params


def inverse_frequencies(params: dict[str, Any], head_dim: int, max_model_len: int) -> torch.Tensor:
    """fp32 [head_dim // 2] inverse frequencies, scaled as the config's rope type says."""
    rope_type = params["rope_type"]
    inv_freq: torch.Tensor = 1.0 / (
        params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    )
    if rope_type == "default":
        return inv_freq.float()
    if rope_type == "linear":
        factor: float = params["factor"]
        return (inv_freq / factor).float()
    if rope_type == "dynamic":
        # Dynamic NTK only changes frequencies beyond the original context, so it equals default below it.
        original = params.get("original_max_position_embeddings") or 0
        if original and max_model_len > original:
            raise ValueError(f"dynamic rope scaling is only supported up to max_model_len={original}")
        return inv_freq.float()
    if rope_type == "llama3":
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float()
    raise ValueError(f"unsupported rope type {rope_type!r} (default, linear, llama3, dynamic)")


def cos_sin_table(inv_freq: torch.Tensor, max_len: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[max_len, 2, head_dim] table: row p holds cos and a signed sin of position p, halves duplicated as
    HF does, the sin's first half negated so that ``rotate_half(x) * sin == roll(x, half) * signed_sin``."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    half = inv_freq.shape[0]
    signed = torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)
    return torch.stack([emb.cos(), signed], dim=1).to(device=device, dtype=dtype)


def rope_factors(cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin: a step's rows of the table [num_tokens, 2, head_dim] -> (cos, signed sin), each
    [num_tokens, 1, head_dim]: split once per step, not once per layer."""
    return cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim] -> rotated copy of x.

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``: the roll gives
    ``cat(x2, x1)`` in one op and the table's sin carries the minus, so the products are bit-identical
    in three ops where the cat of a negated slice took six."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), signed_sin)
