"""What the scheduler holds of a request: the work-queue message's handle, the request waiting in its
queue (``Queued``), and the run a worker accepted (``Inflight``)."""

import time
from dataclasses import dataclass, field
from typing import Protocol

from services.scheduler.admission import Grant
from shared.request_ref import RequestRef
from shared.schemas import InferRequest, SloClass


class Handle(Protocol):
    headers: dict[str, str] | None  # trace context of the submission

    async def ack(self) -> None: ...
    async def term(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...


class ShadowHandle:
    """A shadow run's handle: the scheduler's own submission, on no work queue to settle."""

    headers: dict[str, str] | None = None

    async def ack(self) -> None:
        return None

    async def term(self) -> None:
        return None

    async def nak(self, delay: float | None = None) -> None:
        return None

    async def in_progress(self) -> None:
        return None


@dataclass(slots=True, eq=False)
class Queued:
    request: InferRequest
    handle: Handle
    grant: Grant | None  # None: a shadow run, charged to no quota
    seq: int | None = None  # the work-queue message's stream sequence
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # cancelled while being dispatched: cancelled on the worker that accepts it

    @property
    def tenant(self) -> str:
        return self.request.tenant_id

    @property
    def priority(self) -> SloClass:
        return self.request.priority or "standard"  # set at admission: the tenant's tier when the client named none

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def ref(self) -> RequestRef:
        return RequestRef.of(self.request)


@dataclass(slots=True)
class Inflight:
    request: InferRequest
    worker_id: str
    grant: Grant | None
    seq: int | None = None
    started: float = field(default_factory=time.monotonic)  # when the worker accepted it
