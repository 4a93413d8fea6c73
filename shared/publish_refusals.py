"""A JetStream publish the server turned down, as the typed refusal its caller answers with."""

from nats.js.errors import APIError

from shared.errors import InternalError, LorafleetError, PayloadTooLarge, QuotaExceeded, ServiceUnavailable

# JetStream's answers to a publish beyond a stream's bounds (nats-server's JSStreamStoreFailedF,
# JSInsufficientResourcesErr, JSStreamMessageExceedsMaximumErr), and to one while the stream's
# leader has too many publishes pending (JSStreamTooManyRequests: a flood, for the moment)
_STORE_FAILED, _NO_RESOURCES, _TOO_LARGE, _TOO_MANY = 10077, 10023, 10054, 10167
# ... and while a NATS node fails over: the JetStream system or the stream's leader is not back yet
# (JSClusterNotAvailErr, "JetStream system temporarily unavailable"; JSClusterNotLeaderErr;
# JSStreamOfflineErr). Each clears on its own within an election; a publish may be tried again.
_FAILING_OVER = frozenset({10008, 10009, 10118})


def publish_failing_over(error: APIError) -> bool:
    """A refusal that a NATS node failing over causes and that ends on its own: any 503 but a full
    queue's (answered at once, with Retry-After), and the cluster's not-yet-leader answers."""
    if error.err_code in _FAILING_OVER:
        return True
    return error.code == 503 and error.err_code not in (_STORE_FAILED, _NO_RESOURCES, _TOO_MANY)


def publish_refusal(error: APIError) -> LorafleetError:
    """The typed refusal of a JetStream publish the server turned down: a tenant whose own backlog
    is full is over its quota (429); a full stream or server is unavailable for now (503)."""
    description = error.description or ""
    if error.err_code == _STORE_FAILED and "per subject" in description:
        return QuotaExceeded("too many of this tenant's requests are waiting to be scheduled", retry_after_s=1.0)
    if error.err_code in (_STORE_FAILED, _NO_RESOURCES):
        return ServiceUnavailable(f"the request queue is full ({description})", retry_after_s=1.0)
    if error.err_code == _TOO_MANY:
        return ServiceUnavailable(f"the request queue is overloaded ({description})", retry_after_s=1.0)
    if error.err_code == _TOO_LARGE:
        return PayloadTooLarge(f"the message is larger than the stream takes ({description})")
    if publish_failing_over(error):
        return ServiceUnavailable(f"the request queue is failing over ({description}); retry", retry_after_s=1.0)
    return InternalError(f"the request queue refused the message ({error.err_code}: {description})")
