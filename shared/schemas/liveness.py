"""Worker control and the heartbeats that tell who is alive."""

import time
from typing import Annotated, Literal

from pydantic import Field, model_validator

from shared.schemas.base import Identifier, Message, RequestId

# ---- worker control and liveness -----------------------------------------------------------


class WorkerControl(Message):
    action: Literal["prefetch", "evict", "pin", "unpin", "cancel"]
    request_id: RequestId | None = None
    tenant_id: Identifier | None = None  # a cancel's: request ids are per tenant
    adapter_id: Identifier | None = None
    adapter_version: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _target(self) -> "WorkerControl":
        if self.action == "cancel" and (self.request_id is None or self.tenant_id is None):
            raise ValueError("cancel needs request_id and tenant_id")
        if self.action != "cancel" and self.adapter_id is None:
            raise ValueError(f"{self.action} needs adapter_id")
        return self


ControlOutcome = Literal[
    "done",  # the action took effect (cancelled, loading, evicted, pinned, unpinned)
    "not_running",  # cancel: no such request runs on this worker
    "resident_or_loading",  # prefetch: nothing to do
    "not_resident",  # evict: the adapter holds no slot here
    "pinned",  # evict: pinned adapters stay
    "in_flight",  # evict: requests on the adapter are running; the slot is freed by policy after their last release
]


class WorkerControlReply(Message):
    """A worker's answer to a control message that asked for one (sent with a reply subject)."""

    action: Literal["prefetch", "evict", "pin", "unpin", "cancel"]
    outcome: ControlOutcome


class EngineCapability(Message):
    """What a worker's engine can serve; placement sends an adapter only where its rank and modules fit."""

    engine: Literal["builtin", "vllm"] = "builtin"
    max_lora_rank: int | None = Field(default=None, ge=1, le=1024, description="None: not announced (no rank limit)")
    lora_modules: list[str] = Field(
        default_factory=list, max_length=64, description="modules an adapter may target; empty: not announced"
    )

    def serves(self, rank: int, modules: list[str]) -> bool:
        """Whether an adapter of ``rank`` on ``modules`` fits (an unannounced limit is no limit)."""
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            return False
        return not self.lora_modules or set(modules) <= set(self.lora_modules)


class WorkerHeartbeat(Message):
    worker_id: Identifier
    base_model: str
    ready: bool
    running: int = Field(ge=0)
    waiting: int = Field(ge=0)
    max_running: int = Field(ge=1)
    kv_blocks_free: int = Field(ge=0)
    kv_blocks_total: int = Field(ge=0)
    resident_adapters: list[str] = Field(default_factory=list)
    cpu_adapters: list[str] = Field(
        default_factory=list, description="adapter keys held verified in the worker's CPU tier (a cheap load)"
    )
    slots: dict[str, list[int]] = Field(default_factory=dict, description="rank class -> [slots used, slots]")
    pinned: list[str] = Field(default_factory=list, description="adapter keys pinned on this worker")
    pins_refused: list[str] = Field(
        default_factory=list,
        description="pinned adapter keys this worker cannot hold: their rank class is full of pins",
    )
    cache_hit_ratio: dict[str, float] = Field(default_factory=dict, description="tier -> share of adapter lookups")
    load_ms_mean: dict[str, float] = Field(default_factory=dict, description="source tier -> mean adapter load ms")
    capability: EngineCapability = Field(default_factory=EngineCapability, description="the engine and its LoRA limits")
    rank_pool: list[int] = Field(
        default_factory=list,
        max_length=8,
        description="rank classes this worker serves as a pool (adapters of those classes go here first); "
        "empty: no pool, it serves all its classes alike",
    )
    ts: float = Field(default_factory=time.time)


# A worker's way to serving, in order (building_kernels only for the built-in engine on a CPU), then draining.
WorkerPhase = Literal["building_kernels", "loading_model", "warming", "ready", "draining"]


class ServiceHeartbeat(Message):
    service: Literal["gateway", "scheduler", "worker", "registry", "auditor"]
    instance_id: Identifier
    ready: bool
    detail: str = Field(default="", max_length=500)
    phase: WorkerPhase | None = Field(
        default=None, description="a worker's phase: what a worker that is not ready yet is doing (None elsewhere)"
    )
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description="where its /metrics listens")
    checks_off: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=16,
        description="safety checks an operator turned off on this instance (e.g. release_require_eval)",
    )
    ts: float = Field(default_factory=time.time)


class SupervisedProcess(Message):
    name: str = Field(min_length=1, max_length=64)
    state: Literal["running", "restarting", "failed"]
    restarts: int = Field(ge=0, description="restarts since the supervisor started it")
    detail: str = Field(default="", max_length=2000, description="why it restarts, or its last log lines")


class SupervisorStatus(Message):
    """What ``lorafleet up`` supervises on one machine and the state of each process it started."""

    host: str = Field(min_length=1, max_length=256)
    processes: list[SupervisedProcess] = Field(default_factory=list, max_length=64)
    ts: float = Field(default_factory=time.time)
