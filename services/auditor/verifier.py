"""Verify the chain incrementally from the last signed head, off the event loop, and sign the
new head; or verify all of it against every signed head, on request.

Each tick re-hashes only the records added since the last verified one, checks that the record
the newest signed head names still has that hash (a truncation removes it, a rewrite-and-relink
changes it), and that the rows end in the tip the store wrote, then signs that in-memory tip: a
head never vouches for a row as the file holds it, only as this auditor appended it. A break is kept until restart, and nothing is signed after
it: a later head must never vouch for a chain that was found altered."""

import asyncio
import sqlite3
from collections.abc import Callable
from typing import TypeVar

import structlog

from services.auditor import chain
from services.auditor.chain import Break, Tip
from services.auditor.head_log import HeadLog
from services.auditor.heads import HeadSigner
from services.auditor.store import AuditStore
from shared import metrics
from shared.errors import IntegrityError
from shared.schemas import ChainStatus, SignedHead

log = structlog.get_logger("auditor")
T = TypeVar("T")


class ChainVerifier:
    def __init__(self, store: AuditStore, signer: HeadSigner, heads: HeadLog):
        self._store = store
        self._signer = signer
        self._heads = heads
        self._verified: Tip | None = None
        self._signed: SignedHead | None = None
        self._broken: Break | None = None
        self._full: asyncio.Task | None = None

    async def start(self) -> None:
        """Resume from the newest signed head, once the rows are shown to still hold it."""
        head = await self._heads.latest()
        if head is None:
            return
        try:
            self._signer.check(head)
        except IntegrityError as e:
            self._fail(Break(head.pos, e.message))
            return
        self._signed = head
        if self._fail(await self._in_thread(lambda db: chain.against_head(db, head))) is None:
            self._verified = Tip(head.pos, head.hash, head.stream_seq)

    async def tick(self) -> None:
        """Verify what was added since the last tick and sign the new tip."""
        if self._broken is not None:
            return
        signed, start, tip = self._signed, self._verified, self._store.tip
        new = tip if tip is not None and (start is None or tip.pos > start.pos) else None

        def check(db: sqlite3.Connection) -> Break | None:
            broken = chain.against_head(db, signed) if signed else None
            if broken is None and new is not None:
                broken = chain.against_tip(chain.walk(db, start, new.pos), start, new)
            return broken

        if self._fail(await self._in_thread(check)) is not None or new is None:
            return
        head = self._signer.sign(new)
        await self._heads.append(head)
        self._verified, self._signed = new, head

    async def verify_all(self) -> None:
        """Re-hash the whole chain and hold it against every head this auditor ever signed; callers
        arriving while one runs share it."""
        if self._full is None or self._full.done():
            self._full = asyncio.create_task(self._verify_all())
        await asyncio.shield(self._full)

    async def _verify_all(self) -> None:
        heads = await self._heads.all()
        for head in heads:
            try:
                self._signer.check(head)
            except IntegrityError as e:
                self._fail(Break(head.pos, e.message))
                return
        self._fail(await self._in_thread(lambda db: chain.full(db, heads)))

    @property
    def signed_pos(self) -> int:
        """The record the newest signed head vouches for (0: none yet)."""
        return self._signed.pos if self._signed else 0

    def status(self) -> ChainStatus:
        return ChainStatus(
            intact=self._broken is None,
            broken_at=self._broken.pos if self._broken else None,
            problem=self._broken.problem if self._broken else None,
            count=self._store.last_pos(),
            verified_pos=self._verified.pos if self._verified else 0,
            signed_pos=self._signed.pos if self._signed else None,
            public_key=self._signer.public_key,
        )

    async def _in_thread(self, check: Callable[[sqlite3.Connection], T]) -> T:
        def run() -> T:
            db = self._store.reader()
            try:
                return check(db)
            finally:
                db.close()

        return await asyncio.to_thread(run)

    def _fail(self, broken: Break | None) -> Break | None:
        if broken is not None and self._broken is None:
            self._broken = broken
            metrics.INTEGRITY_ERRORS.labels("auditor").inc()
            log.error("audit_chain_broken", broken_at=broken.pos, problem=broken.problem)
        return broken
