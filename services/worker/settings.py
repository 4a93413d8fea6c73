"""The worker's settings: identity, model, and the engine, adapter-slot and cache configs nested
(``LF_ENGINE__KV_CACHE_BYTES``, ``LF_LORA__MEMORY_BUDGET_BYTES``, ``LF_CACHE__POLICY``...)."""

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.worker.adapter_cache.cache_config import CacheConfig
from services.worker.engine.engine_config import EngineConfig
from services.worker.lora.lora_config import LoraConfig
from services.worker.vllm_engine.vllm_config import VllmConfig
from shared.config import GrammarBounds, WorkerIdentity


class WorkerSettings(WorkerIdentity):
    model_config = SettingsConfigDict(env_prefix="LF_", frozen=True, extra="ignore", env_nested_delimiter="__")

    model_dir: str | None = Field(default=None, description="local HF model directory; None = embedded SmolLM2")
    model_cache: str | None = Field(default=None, description="where the embedded GGUF is converted once")
    worker_engine: Literal["builtin", "vllm"] = Field(
        default="builtin",
        description="LF_WORKER_ENGINE: the built-in engine, or vLLM's async engine in-process (run the worker "
        "with .venv-vllm's python)",
    )
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine sizing when worker_engine=vllm")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="batching, KV cache, device, dtype")
    lora: LoraConfig = Field(
        default_factory=LoraConfig, description="rank classes and the byte budget of the adapter slots"
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="CPU tier, eviction policy, warmup")
    grammar: GrammarBounds = Field(
        default_factory=GrammarBounds, description="grammar compiles: time bound, processes, per-tenant shares"
    )
    max_waiting: int = Field(default=256, ge=1, le=100_000, description="requests queued before dispatches are refused")
    require_signature: bool = Field(
        default=True, description="refuse unsigned adapters (False only beside a dev-mode registry)"
    )
    heat_refresh_s: float = Field(default=5.0, gt=0, le=600, description="how often fleet heat is read from Redis")
    worker_rank_pool: str = Field(
        default="",
        pattern=r"^(|high|[0-9]{1,4}(,[0-9]{1,4}){0,7})$",
        description="LF_WORKER_RANK_POOL: rank classes this worker serves as a pool, placed here first: high "
        "(its largest class) or a list of its classes (32,64); empty: no pool, it serves all classes alike",
    )
    pin_refresh_s: float = Field(
        default=2.0, gt=0, le=600, description="how often the pins are applied again (a failed pinned load retried)"
    )
    adapter_metric_labels: int = Field(
        default=50,
        ge=0,
        le=10_000,
        description="adapters with their own per-adapter metric series: the top N by traffic, re-ranked every "
        "30 s; the rest: other",
    )
    slo_window: int = Field(
        default=500,
        ge=1,
        le=100_000,
        description="recent requests per SLO class that slo_attainment_ratio is computed over",
    )

    @model_validator(mode="after")
    def _lora_fits_engine(self) -> "WorkerSettings":
        if self.lora.max_num_tokens < self.engine.max_num_batched_tokens:
            raise ValueError("lora.max_num_tokens must be >= engine.max_num_batched_tokens")
        return self

    @model_validator(mode="after")
    def _quantized_weights_builtin_only(self) -> "WorkerSettings":
        if self.worker_engine == "vllm" and self.engine.weights != "none":
            raise ValueError(
                f"LF_ENGINE__WEIGHTS={self.engine.weights} is served by the built-in engine only, not LF_WORKER_ENGINE=vllm"
            )
        return self

    @model_validator(mode="after")
    def _pool_of_own_classes(self) -> "WorkerSettings":
        listed = self.worker_rank_pool not in ("", "high")
        if listed and not set(self.rank_pool(self.lora.rank_classes)) <= set(self.lora.rank_classes):
            raise ValueError(f"LF_WORKER_RANK_POOL names a class not in lora.rank_classes {self.lora.rank_classes}")
        return self

    def rank_pool(self, classes: tuple[int, ...]) -> tuple[int, ...]:
        """The pool's rank classes among ``classes`` (the engine's own): () = no pool."""
        if self.worker_rank_pool == "high":
            return (max(classes),)
        if not self.worker_rank_pool:
            return ()
        return tuple(sorted({int(r) for r in self.worker_rank_pool.split(",")}))
