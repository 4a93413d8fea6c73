"""Sizing and policy of the adapter cache tiers: validated once at start-up, never mutated."""

from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

PolicyName = Literal["heat", "lru", "lfu"]
Share = Annotated[float, Field(gt=0, le=1)]


class CacheConfig(BaseModel):
    """GPU slot eviction policy, CPU tier budget, loader threads, warmup and tenant slot quotas."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: PolicyName = Field(default="heat", description="eviction policy of the GPU slots")
    cpu_policy: PolicyName = Field(default="heat", description="eviction policy of the CPU tier")
    cpu_budget_bytes: int = Field(
        default=2**32, ge=0, le=2**42, description="bytes of verified adapter weights kept in CPU memory; 0 = no tier"
    )
    load_threads: int = Field(default=2, ge=1, le=32, description="threads that fetch, verify and copy adapters")
    warmup: tuple[str, ...] = Field(
        default=(), max_length=4096, description="adapter keys (adapter_id@version) prefetched at start"
    )
    half_life_s: float = Field(
        default=10.0, gt=0, le=86400, description="half-life of the decayed request rate the GPU heat policy scores by"
    )
    cpu_half_life_s: float = Field(
        default=60.0, gt=0, le=86400, description="half-life of the CPU tier's heat policy (a longer memory)"
    )
    heat_weight: float = Field(
        default=1.0, ge=0, le=100, description="weight of the fleet heat (scheduler) beside the local decayed rate"
    )
    batch_weight: float = Field(
        default=0.5, gt=0, le=1, description="score multiplier of batch-class adapters: they leave before interactive"
    )
    standard_weight: float = Field(
        default=0.75, gt=0, le=1, description="score multiplier of standard-class adapters (interactive: 1)"
    )
    tenant_slot_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="share of a rank class's slots one tenant may hold before its own coldest adapters go first",
    )
    tenant_cpu_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="share of cpu_budget_bytes one tenant's adapters may hold once the tier is full and another "
        "tenant's adapter needs room: the over-share tenant's coldest are evicted first; 1 = no share",
    )
    tenant_slot_shares: Mapping[str, Share] = Field(
        default_factory=dict, max_length=100_000, description="per-tenant overrides of tenant_slot_share"
    )

    def slot_quota(self, tenant: str | None, class_slots: int) -> int:
        """Slots of a rank class the tenant may hold before it evicts its own first."""
        share = self.tenant_slot_shares.get(tenant, self.tenant_slot_share) if tenant else self.tenant_slot_share
        return max(1, int(share * class_slots))
