"""Check a submission from the INFER work queue before the scheduler takes it."""

import json
import re

from shared import subjects
from shared.bus import decode
from shared.errors import Forbidden, InvalidMessage
from shared.schemas import InferRequest

_INBOX = re.compile(r"_INBOX[._][A-Za-z0-9_.-]{1,250}")  # InferRequest.reply_to's pattern: no wildcard, space or CR/LF
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # what a RequestId may not hold


def parse_submission(subject: str, data: bytes) -> tuple[InferRequest, bool]:
    """(the request, whether it came on the gateway's preview subject), checked against the
    subject's tenant: nobody submits as another tenant."""
    request = decode(InferRequest, data)
    try:
        tenant, preview = subjects.parse_submit(subject)
    except ValueError as e:
        raise InvalidMessage(str(e)) from None
    if tenant != request.tenant_id:
        raise Forbidden("a request's tenant must match the tenant of its submit subject")
    if request.reply_to.startswith("_INBOX_") and not request.reply_to.startswith(f"_INBOX_{request.tenant_id}."):
        raise Forbidden("replies may only go to the requesting tenant's own inbox")
    return request, preview


def refusal_target(subject: str, data: bytes) -> tuple[str, str, str | None]:
    """(tenant, request id, reply inbox or None) of a submission that failed its checks, best effort:
    the inbox only when it is a gateway inbox or the submitting tenant's own, never another tenant's."""
    try:
        tenant = subjects.tenant_of_submit(subject)
    except ValueError:
        tenant = "unknown"
    try:
        raw = json.loads(data)
        rid, reply = raw.get("request_id"), raw.get("reply_to")
    except (ValueError, AttributeError):
        return tenant, "unknown", None
    rid = _UNSAFE.sub("-", rid)[:128] if isinstance(rid, str) and rid else "unknown"
    inbox = isinstance(reply, str) and _INBOX.fullmatch(reply) is not None
    if inbox and reply.startswith(("_INBOX.", f"_INBOX_{tenant}.")):
        return tenant, rid, reply
    return tenant, rid, None
