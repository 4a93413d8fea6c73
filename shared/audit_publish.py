"""Publish an audit record until the AUDIT stream has stored it.

An audit record is the proof of what happened to a request (and the scheduler frees a request's
capacity on its completion record), so a publish that got no acknowledgement (NATS restarting,
a stream leader moving) is retried with pauses; the ``Nats-Msg-Id`` lets the stream drop a retry
of a record it did store before the acknowledgement was lost."""

import asyncio

import structlog
from nats.js import JetStreamContext

from shared import subjects
from shared.bus import encode
from shared.event_loop import keep_cancel
from shared.schemas import AuditEnvelope, AuditEvent

ATTEMPTS = 6  # with the publish timeout and the pauses between, about a minute of NATS outage
log = structlog.get_logger("audit")


async def publish_audit(js: JetStreamContext, event: AuditEvent, msg_id: str, attempts: int = ATTEMPTS) -> bool:
    """True once stored; False (logged) after ``attempts`` failures. ``msg_id`` names this one record."""
    subject, body = subjects.audit(event.kind, event.tenant_id), encode(AuditEnvelope(body=event))
    for attempt in range(1, attempts + 1):
        try:
            await js.publish(subject, body, headers={"Nats-Msg-Id": msg_id})
            return True
        except Exception as e:  # e.g. no ack while NATS restarts
            keep_cancel(e)
            log.warning(
                "audit_publish_failed", request_id=getattr(event, "request_id", None), error=str(e), attempt=attempt
            )
            if attempt < attempts:
                await asyncio.sleep(attempt)
    log.error("audit_record_lost", kind=event.kind, request_id=getattr(event, "request_id", None))
    return False
