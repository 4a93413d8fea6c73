"""Engine configuration: validated once at start-up, never mutated."""

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.worker.engine.attention import CpuAttention
from services.worker.engine.layer_loop import CpuLayerLoop
from services.worker.engine.linear import CpuLinear
from services.worker.engine.model import CpuLayerOps
from services.worker.engine.quant import GroupSize, WeightFormat

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineConfig(BaseModel):
    """Sizing and numerics of one worker engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = Field(default="cpu", min_length=1, max_length=32, description="torch device of weights and KV cache")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="dtype of the engine's weights, activations and KV cache"
    )
    kv_block_size: int = Field(default=16, ge=1, le=256, description="tokens per KV cache block")
    kv_cache_bytes: int = Field(
        default=512 * 2**20, ge=2**16, le=2**40, description="byte budget of the KV cache (all layers, K and V)"
    )
    num_blocks: int | None = Field(
        default=None, ge=1, le=2**22, description="explicit KV block count; overrides kv_cache_bytes when set"
    )
    max_num_seqs: int = Field(default=64, ge=1, le=4096, description="most sequences running in one step")
    max_num_batched_tokens: int = Field(
        default=2048, ge=16, le=2**20, description="most tokens (prefill + decode) in one forward pass"
    )
    max_model_len: int = Field(default=2048, ge=16, le=2**20, description="most tokens (prompt + output) per sequence")
    grammar_cache: int = Field(default=512, ge=1, le=100_000, description="compiled JSON grammars kept, by digest")
    cpu_linear: CpuLinear = Field(
        default="auto",
        description="CPU dense matmuls: auto (a small decode batch's rows through the native small-row "
        "kernel; the rest through the native panel kernel on CPUs without AVX-512 (and for bf16 where oneDNN "
        "has no bf16 GEMM), else oneDNN-prepacked weights, fp32 and bf16, each where its probe passes, else "
        "F.linear; holds the weights twice), torch (F.linear only), onednn / panel (that path for every row "
        "count, refusing to start where it is not usable)",
    )
    weights: WeightFormat = Field(
        default="none",
        description="LF_ENGINE__WEIGHTS: weight-only quantization of every projection and lm_head at load "
        "(CPU, float32 or bfloat16 activations): none (the weights in dtype), int8 (per output channel), "
        "int4 (per group of weight_group_size input features); symmetric, LoRA deltas and the embedding "
        "stay in dtype; fast with dtype=bfloat16 (torch's kernels), float32 dequantizes per call",
    )
    weight_group_size: GroupSize = Field(
        default=32,
        description="LF_ENGINE__WEIGHT_GROUP_SIZE: input features per int4 scale (32, 64 or 128); every "
        "projection's in_features must be divisible by it",
    )
    cpu_attention: CpuAttention = Field(
        default="auto",
        description="CPU decode attention: auto (the native paged kernel, reading each decode's K/V in place, "
        "fp32 and bf16, where it builds for this CPU and passes its probe, else the eager gather and matmuls), "
        "torch (eager only), native (the kernel, refusing to start where it is not usable)",
    )
    cpu_layer_ops: CpuLayerOps = Field(
        default="auto",
        description="CPU steps between a layer's matmuls: auto (native fused ops, each residual add with the next "
        "RMSNorm, RoPE with the K/V cache write, the MLP activation with its product by up, and the greedy "
        "sampler's argmax, fp32 and bf16, where they build for this CPU and pass their probe, else the eager "
        "ops), torch (eager only), native (the fused ops, refusing to start where they are not usable)",
    )
    cpu_layer_loop: CpuLayerLoop = Field(
        default="auto",
        description="CPU decode steps' layer loop: auto (a step of decodes only runs its decoder layers in one native "
        "call, the same ops with the same values, where the native layer ops and decode attention are on, every "
        "projection has a native panel kernel and the step's LoRA deltas are all native; else the Python loop), "
        "python (the Python loop for every step)",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="share the K/V of full prompt blocks between requests with the same tenant, "
        "adapter and leading tokens (computed once, kept until their blocks are needed)",
    )
    tenant_kv_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="share of the built-in engine's KV blocks one tenant's running requests may hold while another tenant's "
        "requests wait: a request that would take its tenant past it waits (others are admitted first), unless "
        "its tenant has nothing running; 1 = no share",
    )
    class_preempt_after_steps: int | None = Field(
        default=2,
        ge=0,
        le=100_000,
        description="steps a waiting request that cannot be admitted (KV blocks, sequence slots or token budget "
        "short) waits before running requests of a lower SLO class are preempted (recomputed later) to make room "
        "for it; a delay in steps, so a stream of interactive arrivals cannot preempt batch work every step; "
        "None = never preempt for a waiting request",
    )
    num_threads: int | None = Field(
        default=None, ge=1, le=1024, description="torch intra-op threads (process-wide); None keeps torch's"
    )

    compute_nice: int = Field(
        default=5,
        ge=0,
        le=19,
        description="scheduling niceness of the step loop and its torch threads on CPU "
        "(the process's event loop, which streams tokens, keeps its own): the busy compute threads yield the "
        "cores at once to the latency-bound I/O, in the worker and in services sharing the machine; 0 = off",
    )

    cuda_graphs: bool = Field(
        default=False,
        description="replay a CUDA graph per batch-size bucket (and, with adapter tokens, per rank class "
        "row-count bucket) for decode-only steps (cuda devices only; prefill and mixed steps run eagerly); "
        "reserves one KV block for the padding rows, and its decode attention spans max_model_len whatever "
        "the sequences' lengths",
    )

    @model_validator(mode="after")
    def _prompt_fits_one_step(self) -> "EngineConfig":
        # A (re)prefill is never split across steps, so a full sequence must fit in one step.
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len")
        return self

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> "EngineConfig":
        if self.cuda_graphs and torch.device(self.device).type != "cuda":
            raise ValueError(f"cuda_graphs needs a cuda device, not {self.device!r}")
        return self

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
