"""Typed errors, each with its HTTP status and stable error code, mapped in one place."""

from typing import ClassVar

from shared.schemas import ErrorBody

_BY_CODE: dict[str, type["LorafleetError"]] = {}


class LorafleetError(Exception):
    """Base of every error that crosses a service boundary."""

    # per-class defaults; an instance may carry its own (RemoteError keeps the remote's)
    status: int = 500
    code: str = "internal_error"
    error_type: ClassVar[str] = "server_error"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _BY_CODE.setdefault(cls.code, cls)

    def __init__(self, message: str, *, retry_after_s: float | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.param = param

    def to_body(self) -> ErrorBody:
        return ErrorBody(
            code=self.code,
            message=self.message,
            status=self.status,
            retry_after_s=self.retry_after_s,
            param=self.param,
        )


class InvalidRequest(LorafleetError):
    status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class InvalidMessage(InvalidRequest):
    code = "invalid_message"


class InvalidSchema(InvalidRequest):
    """A JSON schema (response_format, a tool's parameters) that cannot be enforced while decoding."""

    code = "invalid_json_schema"


class GrammarTooComplex(InvalidRequest):
    """A JSON schema or tools whose grammar does not compile within the worker's time bound (a
    regex ``pattern`` whose automaton explodes, say): refused instead of holding a core for minutes."""

    code = "grammar_too_complex"


class SchemaTooLarge(InvalidRequest):
    """A JSON schema nested deeper, or with more values, than the gateway's bounds."""

    code = "schema_too_large"


class Unauthorized(LorafleetError):
    status = 401
    code = "invalid_api_key"
    error_type = "authentication_error"


class MetricsTokenRequired(Unauthorized):
    """A /metrics scrape without the deployment's bearer token (LF_METRICS_TOKEN_FILE)."""

    code = "metrics_token_required"


class Forbidden(LorafleetError):
    status = 403
    code = "forbidden"
    error_type = "permission_error"


class PriorityNotAllowed(Forbidden):
    """The request asks for an SLO class above its tenant's tier."""

    code = "priority_not_allowed"


class ModelNotFound(LorafleetError):
    """Unknown model, or one this tenant may not use: the same answer for both, by design."""

    status = 404
    code = "model_not_found"
    error_type = "invalid_request_error"


class NotFound(LorafleetError):
    """A named registry object (tenant, API key) that does not exist."""

    status = 404
    code = "not_found"
    error_type = "invalid_request_error"


class PayloadTooLarge(LorafleetError):
    status = 413
    code = "payload_too_large"
    error_type = "invalid_request_error"


class IntegrityError(LorafleetError):
    status = 422
    code = "integrity_error"
    error_type = "invalid_request_error"


class UnservedTarget(IntegrityError):
    """An adapter tensor on a mixture-of-experts module LoRA is not served on (the router, the shared
    expert's gate, a dense-MLP name on a sparse layer): shared.lora_targets."""

    code = "unserved_lora_target"


class QuotaExceeded(LorafleetError):
    status = 429
    code = "quota_exceeded"
    error_type = "rate_limit_error"


class Overloaded(QuotaExceeded):
    """The fleet is past what it serves within this request's SLO class target: refused at once, with
    the delay after which the estimate would admit it, instead of queued to miss its target."""

    code = "overloaded"


class GrammarCompilesBusy(QuotaExceeded):
    """The tenant's concurrent grammar compiles (or every compiler of the worker) stayed taken past the
    compile bound: retry after it."""

    code = "grammar_compiles_busy"


class ServiceUnavailable(LorafleetError):
    status = 503
    code = "service_unavailable"
    error_type = "server_error"


class NoWorkerAvailable(ServiceUnavailable):
    code = "no_worker_available"


class NoResponders(ServiceUnavailable):
    """Nothing subscribes to the subject right now: after a reconnect, possibly only for a moment.

    Told apart by type inside a service (a dispatch retries it); to a client it is the plain
    ``service_unavailable`` it has always been."""


class WorkerLost(ServiceUnavailable):
    code = "worker_lost"


class UpstreamTimeout(LorafleetError):
    status = 504
    code = "upstream_timeout"
    error_type = "server_error"


class Cancelled(LorafleetError):
    status = 499
    code = "cancelled"
    error_type = "invalid_request_error"


class InternalError(LorafleetError):
    pass


class RequestNotFound(NotFound):
    """A request id the caller's tenant never made (or one not yet in the audit trail): the same
    answer for another tenant's request as for a missing one, by design."""

    code = "request_not_found"


class Conflict(LorafleetError):
    """A registry change that contradicts the current state (version taken, wrong lifecycle step)."""

    status = 409
    code = "conflict"
    error_type = "invalid_request_error"


class AdapterNotReleased(ModelNotFound):
    """The tenant may use the adapter, but no version of it is released (staging or retired)."""

    code = "adapter_not_released"


class AdapterRevoked(LorafleetError):
    """The version was revoked as a security stop; it is never served again."""

    status = 410
    code = "adapter_revoked"
    error_type = "invalid_request_error"


class RemoteError(LorafleetError):
    """An error whose type this process does not know: keeps the remote's code and status."""

    def __init__(self, body: ErrorBody):
        super().__init__(body.message, retry_after_s=body.retry_after_s, param=body.param)
        self.code = body.code
        self.status = body.status


def from_body(body: ErrorBody) -> LorafleetError:
    """Rebuild the typed error a remote service reported (every subclass registers its code)."""
    cls = _BY_CODE.get(body.code)
    if cls is None or cls.status != body.status:
        return RemoteError(body)
    return cls(body.message, retry_after_s=body.retry_after_s, param=body.param)


class NoFreeSlot(ServiceUnavailable):
    """Every GPU slot of the adapter's rank class is taken: evict one, or wait."""

    code = "no_free_slot"


class ReleaseGateFailed(Conflict):
    """Promotion refused: no eval recorded, a score under the threshold, or a regression vs production."""

    code = "release_gate_failed"


class PinsExceedSlots(Conflict):
    """A pin that would leave a rank class of some worker with more pinned adapters than slots."""

    code = "pins_exceed_slots"


class SignerNotAuthorized(Forbidden):
    """A push signed by a trusted signer that is not bound to the pushing tenant."""

    code = "signer_not_authorized"


class RequestIdInUse(Conflict):
    """The tenant already submitted a request under this id (queued, running, or served within the
    dedupe window): the new submission is refused, the first one is left alone."""

    code = "request_id_in_use"


class RankNotServed(InvalidRequest):
    """A push of an adapter whose rank no rank class of the fleet (live workers, else LF_FLEET_RANK_CLASSES) holds."""

    code = "rank_not_served"


class RemoteSourceDisabled(Forbidden):
    """The registry does not fetch from this kind of remote source (s3 / https are off by default)."""

    code = "remote_source_disabled"


class SourceNotAllowed(Forbidden):
    """The remote URI is on no allow-list entry bound to the pushing tenant; the same answer
    whether no entry matches or one matches for other tenants only."""

    code = "source_not_allowed"


class SourceNotApproved(Forbidden):
    """The allow-list entry asks for each URI to be approved by an operator before its first use."""

    code = "source_not_approved"


class SourceAddressRefused(Forbidden):
    """The source's host resolves to a loopback, link-local, private or otherwise internal address."""

    code = "source_address_refused"


class SourceRedirectRefused(Forbidden):
    """The source redirected outside the allow-list, or more often than allowed."""

    code = "source_redirect_refused"


class SourceFileRefused(InvalidRequest):
    """The source holds or names a file other than the two adapter files, or too many files."""

    code = "source_file_refused"


class SourceTooLarge(PayloadTooLarge):
    """A fetched file, or all of them together, exceeded the fetch's byte limit."""

    code = "source_too_large"


class SourceTimeout(UpstreamTimeout):
    """The fetch did not finish within its time limit."""

    code = "source_timeout"


class SourceFetchFailed(LorafleetError):
    """The remote source answered with an error, failed TLS verification, or could not be reached."""

    status = 502
    code = "source_fetch_failed"
    error_type = "server_error"


class SourceFetchesBusy(QuotaExceeded):
    """The tenant already runs as many remote fetches on this registry replica as it may: refused at
    once with a Retry-After, never queued."""

    code = "source_fetches_busy"


class FetchCapacityFull(ServiceUnavailable):
    """The registry replica already runs as many remote fetches as it may, all tenants together:
    refused at once with a Retry-After, never queued."""

    code = "fetch_capacity_full"


class SpoolFull(LorafleetError):
    """The fetches in flight on this registry replica, all tenants together, hold its whole spool
    quota: the fetch is stopped, its spool deleted, and the push refused with a Retry-After."""

    status = 507
    code = "spool_full"
    error_type = "server_error"


class TenantSpoolFull(SpoolFull):
    """The tenant's fetches in flight hold its whole spool quota on this registry replica."""

    code = "tenant_spool_full"


class TaskNotFound(ModelNotFound):
    """A request named a task its tenant has no route for; the message lists only what the tenant may call."""

    code = "task_not_found"


class RoutePolicyRefused(Forbidden):
    """A routing policy rule refuses the request (its rule's own message)."""

    code = "route_policy_refused"
    rule: str | None = None  # the refusing rule, for /admin/route/explain
    scope: str | None = None
