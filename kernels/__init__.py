"""LoRA ops: shrink (x @ A) and expand (@ B, scaled, added into y), per token's adapter row.

``reference`` holds the plain-torch ops (the CPU path and the kernels' reference), ``bgmv`` and
``sgmv`` the Triton kernels, ``dispatch`` the per-step index and the device-based choice.
"""

from kernels.dispatch import LoraIndex, add_lora, find_segments, index_for

__all__ = ["LoraIndex", "add_lora", "find_segments", "index_for"]
