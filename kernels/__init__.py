"""LoRA ops: shrink (x @ A) and expand (@ B, scaled, added into y), per token's adapter row.

``reference`` holds the plain-torch ops (the kernels' reference, and the CPU path for prefill
segments), ``native`` the CPU kernels built for this machine (``lora_bgmv``: one call per projection
group for decode-like steps), ``bags`` the CPU fp32 decode path where no native build is usable (embedding
bags reading adapter rows in place), ``bgmv`` and ``sgmv`` the Triton kernels, ``dispatch`` the
per-step index and the choice.
"""

from kernels.dispatch import LoraGroup, LoraIndex, add_lora, add_lora_group, find_segments, index_for

__all__ = ["LoraGroup", "LoraIndex", "add_lora", "add_lora_group", "find_segments", "index_for"]
