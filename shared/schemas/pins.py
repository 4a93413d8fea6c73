"""Adapter pins: durable registry state (KV ``lf_pins``) that every worker it names keeps resident."""

import time

from pydantic import Field

from shared.schemas.base import Identifier, Message
from shared.schemas.registry import Actor

FLEET = "fleet"  # the KV key's scope token of a pin on every worker


class PinRecord(Message):
    """Keep ``adapter_id`` (one version, or each version it serves) in a GPU slot on one worker or on all."""

    adapter_id: Identifier
    tenant_id: Identifier = Field(description="the adapter's owner")
    version: int | None = Field(default=None, ge=1, description="None = whatever version is served")
    worker_id: Identifier | None = Field(default=None, description="None = every worker")
    actor: Actor
    created_at: float = Field(default_factory=time.time)

    @property
    def key(self) -> str:
        """``<adapter_id>.<fleet|w-<worker>>.<v<N>|served>``: a worker id never collides with ``fleet``."""
        scope = FLEET if self.worker_id is None else f"w-{self.worker_id}"
        return f"{self.adapter_id}.{scope}.{'served' if self.version is None else f'v{self.version}'}"

    def applies_to(self, worker_id: str) -> bool:
        return self.worker_id in (None, worker_id)


class PinRequest(Message):
    """Pin (or, on ``lf.registry.unpin``, unpin) an adapter; refused for an adapter the caller does not own."""

    adapter_id: Identifier
    version: int | None = Field(default=None, ge=1, description="None = whatever version is served")
    worker_id: Identifier | None = Field(default=None, description="None = every worker")
    tenant_id: Identifier | None = Field(
        default=None, description="the caller's tenant: only its own adapters; None = an operator (any adapter)"
    )
    actor: Actor


class ListPinsRequest(Message):
    tenant_id: Identifier | None = Field(default=None, description="None = every tenant's pins")
    adapter_id: Identifier | None = Field(default=None, description="None = every adapter's")


class PinsReply(Message):
    pins: list[PinRecord] = Field(default_factory=list)
