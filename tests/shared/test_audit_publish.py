"""publish_audit against a real JetStream: a record is stored once however often it is retried, a
publish nobody acknowledges is retried until the stream is there, and giving up is reported."""

import asyncio

import nats

from shared import subjects
from shared.audit_publish import publish_audit
from shared.bus import ensure_streams
from shared.schemas import RejectionAudit


def _event(request_id: str) -> RejectionAudit:
    return RejectionAudit(
        request_id=request_id,
        tenant_id="acme",
        service="scheduler",
        code="quota_exceeded",
        reason="over its requests_per_min limit",
    )


async def _stored(js) -> int:
    return (await js.stream_info(subjects.AUDIT_STREAM)).state.messages


async def test_retries_until_stored_and_the_message_id_drops_repeats(own_nats):
    nc = await nats.connect(own_nats.url)
    try:
        js = nc.jetstream(timeout=0.5)
        # no AUDIT stream yet: the first attempt gets no acknowledgement; the stream appears before the second
        pending = asyncio.create_task(publish_audit(js, _event("r1"), "rejection.scheduler.a", attempts=3))
        await asyncio.sleep(0.2)
        assert not pending.done()
        await ensure_streams(js)
        assert await asyncio.wait_for(pending, 10) is True
        assert await _stored(js) == 1
        # the same record again (a retry whose first ack was lost): the stream keeps one copy
        assert await publish_audit(js, _event("r1"), "rejection.scheduler.a") is True
        assert await _stored(js) == 1
        assert await publish_audit(js, _event("r1"), "rejection.scheduler.b") is True  # another record
        assert await _stored(js) == 2
    finally:
        await nc.close()


async def test_gives_up_after_its_attempts_and_says_so(own_nats):
    nc = await nats.connect(own_nats.url)
    try:
        js = nc.jetstream(timeout=0.3)  # never an AUDIT stream here
        assert await asyncio.wait_for(publish_audit(js, _event("r2"), "rejection.scheduler.c", attempts=2), 10) is False
    finally:
        await nc.close()
