"""Identifiers, the Message base and the error body every reply may carry."""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
RequestId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]

# SLO classes, highest first: a tenant's tier is the highest class its requests may ask for
SloClass = Literal["interactive", "standard", "batch"]
SLO_CLASSES: tuple[SloClass, ...] = ("interactive", "standard", "batch")


def slo_rank(slo_class: SloClass) -> int:
    """0 for the highest class (interactive), growing downwards."""
    return SLO_CLASSES.index(slo_class)


class Message(BaseModel):
    """Base for bus messages: unknown fields are refused, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ErrorBody(Message):
    code: str = Field(max_length=64)
    message: str = Field(max_length=2000)
    status: int = Field(ge=400, le=599)
    retry_after_s: float | None = None
    param: str | None = None
