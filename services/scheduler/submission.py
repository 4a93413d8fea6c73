"""Check a submission from the INFER work queue before the scheduler takes it: its subject, inbox,
accept deadline and SLO class."""

import json
import re

from shared import subjects
from shared.bus import decode
from shared.errors import Forbidden, InvalidMessage, PriorityNotAllowed, UpstreamTimeout
from shared.schemas import InferRequest, SloClass, TenantQuota, slo_rank

_INBOX = re.compile(r"_INBOX[._][A-Za-z0-9_.-]{1,250}")  # InferRequest.reply_to's pattern: no wildcard, space or CR/LF
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what a RequestId may not hold


def parse_submission(subject: str, data: bytes) -> tuple[InferRequest, bool]:
    """(the request, whether it came on the gateway's preview subject), checked against the
    subject's tenant and origin: nobody submits as another tenant, and a direct-NATS tenant's
    replies go to its own inbox only (never a gateway inbox, which it cannot read)."""
    request = decode(InferRequest, data)
    try:
        tenant, via = subjects.parse_submit(subject)
    except ValueError as e:
        raise InvalidMessage(str(e)) from None
    if tenant != request.tenant_id:
        raise Forbidden("a request's tenant must match the tenant of its submit subject")
    own = request.reply_to.startswith(f"_INBOX_{tenant}.")
    if not own and (via == subjects.VIA_TENANT or request.reply_to.startswith("_INBOX_")):
        raise Forbidden("replies may only go to the requesting tenant's own inbox")
    if via == subjects.VIA_TENANT and request.route_facts is not None:
        # the caller's key and headers are the gateway's to vouch for: a direct client claims none
        request = request.model_copy(update={"route_facts": None})
    if request.experiment is not None or request.arm is not None:
        # the scheduler's routing step assigns the experiment and arm: a submission claims none
        request = request.model_copy(update={"experiment": None, "arm": None})
    return request, via == subjects.VIA_PREVIEW


PUBLISHED = ("request_id", "tenant_id", "reply_to")  # what every real publisher (gateway, tenant client) sets


def refusal_target(subject: str, data: bytes) -> tuple[str, str, str | None] | None:
    """(tenant, request id, reply inbox or None) of a submission that failed its checks, best effort:
    the inbox only when it is the submitting tenant's own, or a gateway inbox on the gateway's
    subject, never another tenant's. None when the body is no submission at all, a JSON object
    without what every publisher sets (``PUBLISHED``): a JetStream acknowledgement or a refusal sent
    here by someone's reply subject, or noise. Nobody asked for such a thing, so nobody is answered
    and nothing is audited under the subject's tenant, who may never have sent it."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or any(field not in raw for field in PUBLISHED):
        return None
    try:
        tenant, via = subjects.parse_submit(subject)
    except ValueError:
        return "unknown", "unknown", None
    rid, reply = raw["request_id"], raw["reply_to"]
    rid = _UNSAFE.sub("-", rid)[:128] if isinstance(rid, str) and rid else "unknown"
    inbox = isinstance(reply, str) and _INBOX.fullmatch(reply) is not None
    mine = (f"_INBOX_{tenant}.",) if via == subjects.VIA_TENANT else ("_INBOX.", f"_INBOX_{tenant}.")
    if inbox and reply.startswith(mine):
        return tenant, rid, reply
    return tenant, rid, None


def past_accept_deadline(request: InferRequest, wall: float) -> UpstreamTimeout | None:
    """The refusal of a request whose client said it stops waiting before ``wall`` (None: it still waits)."""
    if request.accept_deadline is None or wall <= request.accept_deadline:
        return None
    return UpstreamTimeout("the request's accept deadline passed before it was scheduled")


def slo_class_of(request: InferRequest, quota: TenantQuota) -> SloClass:
    """The class the request runs in: the one it asks for, at most its tenant's tier (above it:
    refused, never lowered silently), or the tier when it asks for none."""
    tier = quota.slo_tier or "standard"
    if request.priority is None:
        return tier
    if slo_rank(request.priority) < slo_rank(tier):
        raise PriorityNotAllowed(
            f"priority {request.priority} is above tenant {request.tenant_id}'s tier ({tier})", param="priority"
        )
    return request.priority
