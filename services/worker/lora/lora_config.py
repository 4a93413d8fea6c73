"""Sizing of the adapter slot pool: validated once at start-up, never mutated."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.worker.lora.layout import MODULES, Module


class LoraConfig(BaseModel):
    """Rank classes, the byte budget of the GPU slots and how it is split among the classes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank_classes: tuple[int, ...] = Field(
        default=(8, 16, 32, 64),
        min_length=1,
        max_length=8,
        description="ascending ranks; an adapter of rank r lives in the smallest class >= r; "
        "the largest is the admitted maximum",
    )
    memory_budget_bytes: int = Field(
        default=2**30,
        ge=2**16,
        le=2**40,
        description="bytes of stacked A/B slot weights, all classes and layers together",
    )
    class_shares: tuple[float, ...] | None = Field(
        default=None, description="fraction of the budget per rank class, in rank_classes order; None = equal bytes"
    )
    max_slots_per_class: int = Field(
        default=256, ge=1, le=65536, description="cap on the slots of one rank class, whatever the budget allows"
    )
    target_modules: tuple[Module, ...] = Field(
        default=MODULES,
        min_length=1,
        max_length=len(MODULES),
        description="projections the slots hold; adapters may target any subset, others are refused; on a "
        "mixture-of-experts model the experts.* modules hold every expert's A and B (most of a slot's bytes: "
        "leave them out to fit more adapters of attention only), on a dense model they cost nothing",
    )
    max_num_tokens: int = Field(
        default=2048, ge=1, le=2**20, description="most tokens in one step: sizes the per-step metadata buffers"
    )
    cpu_kernel: Literal["auto", "torch", "native"] = Field(
        default="auto",
        description="CPU LoRA shrink / expand: auto (the native kernel, one call per projection reading each "
        "token's adapter in place, fp32 and bf16, where it builds for this CPU and passes its probe, else the "
        "eager forms), torch (eager only), native (the kernel, refusing to start where it is not usable)",
    )

    @field_validator("rank_classes")
    @classmethod
    def _ascending_ranks(cls, ranks: tuple[int, ...]) -> tuple[int, ...]:
        if any(r < 1 or r > 1024 for r in ranks) or list(ranks) != sorted(set(ranks)):
            raise ValueError("rank_classes must be strictly ascending ranks in [1, 1024]")
        return ranks

    @field_validator("target_modules")
    @classmethod
    def _distinct_modules(cls, modules: tuple[Module, ...]) -> tuple[Module, ...]:
        if len(set(modules)) != len(modules):
            raise ValueError("target_modules must not repeat a module")
        return tuple(m for m in MODULES if m in modules)

    @model_validator(mode="after")
    def _shares_match_classes(self) -> "LoraConfig":
        shares = self.class_shares
        if shares is not None and (len(shares) != len(self.rank_classes) or any(s <= 0 for s in shares)):
            raise ValueError("class_shares needs one positive share per rank class")
        return self

    @property
    def max_rank(self) -> int:
        return self.rank_classes[-1]

    def class_budgets(self) -> list[int]:
        """Bytes given to each rank class."""
        shares = self.class_shares or (1.0,) * len(self.rank_classes)
        total = sum(shares)
        return [int(self.memory_budget_bytes * s / total) for s in shares]
