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
