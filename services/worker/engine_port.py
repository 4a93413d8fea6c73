"""The seam between the worker's service tier and whichever engine generates: built-in or vLLM.

RequestServer and the heartbeats talk to this protocol only; ``LF_WORKER_ENGINE`` picks the
implementation at start-up (services/worker/service.py)."""

from collections.abc import AsyncIterator
from typing import Protocol

from services.worker.engine.async_engine import EngineStats
from services.worker.engine.sequence import EngineRequest, RequestOutput


class WorkerEngine(Protocol):
    """An engine the worker drives: start once, stream requests, cancel by id, shut down at exit."""

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def stats(self) -> EngineStats:
        """Running and waiting requests and KV cache occupancy, as the heartbeat reports them."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs (text deltas); the last has ``finished`` set. The worker
        names the request by ``RequestRef.engine_id()`` (tenant and request id in one string:
        request ids are per tenant), so one request id of two tenants is two engine requests.

        Raises a typed InvalidRequest (RequestTooLarge, UnsupportedSampling...) before the first
        output when the engine cannot serve the request as asked. Leaving the iterator early, or
        cancelling the task consuming it, aborts the request.
        """
        ...

    def cancel(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish reason "abort"."""
        ...
