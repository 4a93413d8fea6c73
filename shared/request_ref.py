"""How every in-flight structure names a request. Request ids are per tenant (two tenants may use
the same id at once), so only the pair (tenant, request id) names one request."""

from typing import NamedTuple

from shared.schemas import InferRequest, WorkerControl


class RequestRef(NamedTuple):
    tenant: str
    request_id: str

    @classmethod
    def of(cls, request: InferRequest) -> "RequestRef":
        return cls(request.tenant_id, request.request_id)

    def engine_id(self) -> str:
        """The one string an engine knows the request by. Neither part can hold a ``/`` (a tenant
        is a subject token, a request id matches RequestId), so two pairs never give one string."""
        return f"{self.tenant}/{self.request_id}"

    def cancel(self) -> WorkerControl:
        """The control message that cancels this request on a worker (or in the scheduler's queue)."""
        return WorkerControl(action="cancel", request_id=self.request_id, tenant_id=self.tenant)
