"""Signed heads on the AUDIT_HEADS stream (deny delete, deny purge): what the auditor signed
stays there, whatever later happens to its SQLite file."""

from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from shared import subjects
from shared.bus import decode, encode, settling
from shared.errors import InvalidMessage
from shared.schemas import SignedHead
from shared.undecodable import skip

READ_TIMEOUT_S = 5.0


class HeadLog:
    def __init__(self, js: JetStreamContext, auditor_id: str):
        self._js = js
        self._subject = subjects.auditor_head(auditor_id)

    async def append(self, head: SignedHead) -> None:
        await self._js.publish(self._subject, encode(head), stream=subjects.AUDIT_HEADS_STREAM)

    @settling  # read at start-up, when a new cluster may still be placing the stream
    async def latest(self) -> SignedHead | None:
        """The newest head on this auditor's subject that decodes; anything else there is skipped."""
        try:
            msg = await self._js.get_last_msg(subjects.AUDIT_HEADS_STREAM, self._subject)
        except NotFoundError:
            return None
        try:
            return decode(SignedHead, msg.data or b"")
        except InvalidMessage:  # kept forever (the stream denies deletes): read past it
            heads = await self.all()
            return heads[-1] if heads else None

    async def all(self) -> list[SignedHead]:
        """Every head this auditor ever published, oldest first. A message on its subject that is no
        head (the stream keeps whatever was stored) is skipped and counted; the signature check of
        each head is the verifier's."""
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
                seq = msg.metadata.sequence.stream
                try:
                    heads.append(decode(SignedHead, msg.data))
                except InvalidMessage as e:
                    skip(subjects.AUDIT_HEADS_STREAM, str(seq), e)
                if seq >= (last or 0):
                    return heads
        finally:
            await sub.unsubscribe()
