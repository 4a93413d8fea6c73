"""The sha256 hash chain: each record's hash covers its body and the previous record's hash.

The chain alone proves only that the rows agree with each other: whoever can write the file can
edit a record and re-link everything after it, or drop the newest rows. Signed heads
(``heads.py``) pin what the chain was; the checks here compare the rows with them."""

import hashlib
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass

from shared.schemas import SignedHead

GENESIS = "0" * 64


def link(prev_hash: str, seq: int, body: str) -> str:
    return hashlib.sha256(f"{prev_hash}|{seq}|{body}".encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tip:
    """The newest record of a verified stretch of the chain."""

    pos: int
    hash: str
    stream_seq: int


@dataclass(frozen=True, slots=True)
class Break:
    pos: int  # the first record that is wrong, missing, or may have been rewritten
    problem: str


def walk(db: sqlite3.Connection, start: Tip | None, until: int | None = None) -> Tip | Break | None:
    """Re-hash every record after ``start`` (None: from genesis) to the newest one (or to ``until``):
    the new tip, the first broken link, or None when there is nothing past ``start``."""
    prev, expected = (start.hash, start.pos + 1) if start else (GENESIS, 1)
    tip: Tip | None = None
    rows: Iterable[tuple[int, int, str, str, str]] = db.execute(
        "SELECT pos, stream_seq, body, prev_hash, hash FROM audit WHERE pos >= ? AND pos <= ? ORDER BY pos",
        (expected, until if until is not None else 2**62),
    )
    for pos, stream_seq, body, prev_hash, hash_ in rows:
        if pos != expected:
            return Break(expected, f"record {expected} is missing")
        if prev_hash != prev or link(prev, pos, body) != hash_:
            return Break(pos, f"record {pos} does not link to the record before it: altered, dropped or moved")
        prev, expected, tip = hash_, pos + 1, Tip(pos, hash_, stream_seq)
    return tip


def against_tip(found: Tip | Break | None, start: Tip | None, written: Tip) -> Break | None:
    """Whether the rows re-hashed up to ``written`` (the tip this process appended) end in it: a record
    after ``start`` rewritten on disk and the chain re-linked gives another hash at its position."""
    if isinstance(found, Break):
        return found
    since = start.pos + 1 if start else 1
    if found is None or found.pos != written.pos:
        return Break(since, f"truncated: record {written.pos}, written by this auditor, is gone")
    if found.hash != written.hash:
        return Break(
            since,
            f"rewritten: record {written.pos} no longer has the hash this auditor wrote; "
            f"a record from {since} to {written.pos} was altered and the chain re-linked",
        )
    return None


def against_head(db: sqlite3.Connection, head: SignedHead, since: int = 1) -> Break | None:
    """Whether the rows still hold what ``head`` signed: the record at its position with its hash.
    ``since`` is the first record that may differ (the one after the previous head that matched)."""
    row = db.execute("SELECT hash FROM audit WHERE pos = ?", (head.pos,)).fetchone()
    if row is None:
        newest = db.execute("SELECT COALESCE(MAX(pos), 0) FROM audit").fetchone()[0]
        return Break(
            min(newest + 1, head.pos),
            f"truncated: a head signed at {head.ts:.0f} covers {head.pos} records, record {head.pos} is gone"
            f" (the index ends at {newest})",
        )
    if row[0] != head.hash:
        return Break(
            since,
            f"rewritten: record {head.pos} no longer has the hash signed at {head.ts:.0f}; "
            f"a record from {since} to {head.pos} was altered and the chain re-linked",
        )
    return None


def full(db: sqlite3.Connection, heads: list[SignedHead]) -> Break | None:
    """The whole chain re-hashed from genesis, then held against every signed head in order."""
    found = walk(db, None)
    if isinstance(found, Break):
        return found
    since = 1
    for head in sorted(heads, key=lambda h: h.pos):
        broken = against_head(db, head, since)
        if broken is not None:
            return broken
        since = head.pos + 1
    return None
