"""Signed heads on the AUDIT_HEADS stream (deny delete, deny purge): what the auditor signed
stays there, whatever later happens to its SQLite file."""

from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from shared import subjects
from shared.bus import decode, encode, settling
from shared.schemas import SignedHead

READ_TIMEOUT_S = 5.0


class HeadLog:
    def __init__(self, js: JetStreamContext, auditor_id: str):
        self._js = js
        self._subject = subjects.auditor_head(auditor_id)

    async def append(self, head: SignedHead) -> None:
        await self._js.publish(self._subject, encode(head), stream=subjects.AUDIT_HEADS_STREAM)

    @settling  # read at start-up, when a new cluster may still be placing the stream
    async def latest(self) -> SignedHead | None:
        try:
            msg = await self._js.get_last_msg(subjects.AUDIT_HEADS_STREAM, self._subject)
        except NotFoundError:
            return None
        return decode(SignedHead, msg.data or b"")

    async def all(self) -> list[SignedHead]:
        """Every head this auditor ever published, oldest first."""
        try:
            last = (await self._js.get_last_msg(subjects.AUDIT_HEADS_STREAM, self._subject)).seq
        except NotFoundError:
            return []
        heads: list[SignedHead] = []
        sub = await self._js.subscribe(
            self._subject,
            stream=subjects.AUDIT_HEADS_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )
        try:
            while True:
                msg = await sub.next_msg(READ_TIMEOUT_S)
                heads.append(decode(SignedHead, msg.data))
                if msg.metadata.sequence.stream >= (last or 0):
                    return heads
        finally:
            await sub.unsubscribe()
