"""Signed chain heads on AUDIT_HEADS (a real nats-server): an edited and re-linked chain, and a
chain whose newest records were deleted, are found broken although every link still verifies."""

import asyncio
import contextlib
import os
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.js.errors import APIError
from prometheus_client import REGISTRY

from lorafleet.cli.stack import Stack
from services.auditor.chain import GENESIS, Tip, link, walk
from services.auditor.head_log import HeadLog
from services.auditor.heads import HeadSigner, load_or_create_key
from services.auditor.store import AuditStore
from services.auditor.verifier import ChainVerifier
from shared import subjects
from shared.bus import ensure_streams
from shared.errors import IntegrityError
from shared.schemas import SignedHead
from tests.auditor.test_auditor_restart import publish, wait_count


def record(i: int) -> dict:
    return {"kind": "completion", "tenant_id": "acme", "request_id": f"r{i}", "ts": time.time(), "n": i}


def fill(store: AuditStore, start: int, stop: int) -> None:
    for i in range(start, stop):
        assert store.append(i, record(i))


def relink_from(path: Path, pos: int, edit: str, replacement: str) -> None:
    """What an operator with file access does to hide an edit: rewrite a body, then re-hash every
    record from it on so that each link verifies again."""
    with sqlite3.connect(path) as db:
        body = db.execute("SELECT body FROM audit WHERE pos = ?", (pos,)).fetchone()[0]
        db.execute("UPDATE audit SET body = ? WHERE pos = ?", (body.replace(edit, replacement), pos))
        prev = db.execute("SELECT hash FROM audit WHERE pos = ?", (pos - 1,)).fetchone()
        prev_hash = prev[0] if prev else GENESIS
        for p, text in db.execute("SELECT pos, body FROM audit WHERE pos >= ? ORDER BY pos", (pos,)).fetchall():
            new = link(prev_hash, p, text)
            db.execute("UPDATE audit SET prev_hash = ?, hash = ? WHERE pos = ?", (prev_hash, new, p))
            prev_hash = new


class World:
    def __init__(self, nc, tmp_path: Path):
        self.js = nc.jetstream()
        self.chain_id = f"c{uuid.uuid4().hex[:10]}"
        self.path = tmp_path / "audit.db"
        self.store = AuditStore(self.path)
        self.signer = HeadSigner(self.chain_id, load_or_create_key(tmp_path / "head.key"))

    def store_tip(self) -> Tip:
        with contextlib.closing(self.store.reader()) as db:
            tip = walk(db, None)
        assert isinstance(tip, Tip)
        return tip

    def verifier(self) -> ChainVerifier:
        return ChainVerifier(self.store, self.signer, HeadLog(self.js, self.chain_id))


@pytest.fixture
async def world(nats_url: str, tmp_path: Path) -> AsyncIterator[World]:
    nc = await nats.connect(nats_url)
    await ensure_streams(nc.jetstream())
    w = World(nc, tmp_path)
    yield w
    w.store.close()
    await nc.close()


async def test_rewrite_and_relink_is_found_though_every_link_verifies(world: World) -> None:
    verifier = world.verifier()
    await verifier.start()
    fill(world.store, 1, 11)
    await verifier.tick()
    fill(world.store, 11, 21)
    await verifier.tick()
    assert (verifier.status().signed_pos, verifier.status().intact) == (20, True)

    relink_from(world.path, 15, '"n":15', '"n":99')
    assert world.store.verify() is None  # the unkeyed chain alone calls this intact
    await verifier.tick()
    status = verifier.status()
    assert not status.intact and status.problem and status.problem.startswith("rewritten")

    await verifier.verify_all()  # the heads at 10 and 20 bracket the edit
    fresh = world.verifier()
    await fresh.verify_all()
    assert (fresh.status().intact, fresh.status().broken_at) == (False, 11)


async def test_deleting_the_newest_records_is_found(world: World) -> None:
    verifier = world.verifier()
    fill(world.store, 1, 21)
    await verifier.tick()
    with sqlite3.connect(world.path) as db:
        db.execute("DELETE FROM audit WHERE pos > 17")
    assert world.store.verify() is None
    await verifier.tick()
    status = verifier.status()
    assert (status.intact, status.broken_at) == (False, 18)
    assert status.problem and status.problem.startswith("truncated")
    fill(world.store, 100, 110)  # new records in the gap do not hide it, and nothing more is signed
    await verifier.tick()
    assert (verifier.status().intact, verifier.status().signed_pos) == (False, 20)


async def test_a_restart_resumes_from_the_signed_head_and_finds_a_truncation(world: World) -> None:
    first = world.verifier()
    fill(world.store, 1, 31)
    await first.tick()
    restarted = world.verifier()
    await restarted.start()
    assert (restarted.status().intact, restarted.status().verified_pos) == (True, 30)
    fill(world.store, 31, 36)
    await restarted.tick()  # incremental: from the head at 30 to 35
    assert (restarted.status().verified_pos, restarted.status().signed_pos) == (35, 35)

    with sqlite3.connect(world.path) as db:
        db.execute("DELETE FROM audit WHERE pos > 5")
    after_truncation = world.verifier()
    await after_truncation.start()
    assert (after_truncation.status().intact, after_truncation.status().broken_at) == (False, 6)


async def test_a_head_signed_by_another_key_is_not_believed(world: World, tmp_path: Path) -> None:
    fill(world.store, 1, 4)
    forger = HeadSigner(world.chain_id, load_or_create_key(tmp_path / "other.key"))
    await HeadLog(world.js, world.chain_id).append(forger.sign(world.store_tip()))
    verifier = world.verifier()
    await verifier.start()
    status = verifier.status()
    assert not status.intact and status.problem and "key other than this auditor's" in status.problem


async def test_the_heads_stream_refuses_deletes_and_purges(world: World) -> None:
    verifier = world.verifier()
    fill(world.store, 1, 3)
    await verifier.tick()
    last = await world.js.get_last_msg(subjects.AUDIT_HEADS_STREAM, subjects.auditor_head(world.chain_id))
    with pytest.raises(APIError):
        await world.js.delete_msg(subjects.AUDIT_HEADS_STREAM, last.seq or 0)
    with pytest.raises(APIError):
        await world.js.purge_stream(subjects.AUDIT_HEADS_STREAM)
    info = await world.js.stream_info(subjects.AUDIT_HEADS_STREAM)
    config = info.config
    config.deny_delete = False
    with pytest.raises(APIError):
        await world.js.update_stream(config)
    assert (await HeadLog(world.js, world.chain_id).latest()) is not None


def skipped_heads() -> float:
    return REGISTRY.get_sample_value("undecodable_messages_total", {"source": subjects.AUDIT_HEADS_STREAM}) or 0.0


async def test_what_is_no_head_on_the_heads_subject_is_skipped_and_counted(world: World) -> None:
    """The stream keeps whatever was stored, for good (deny delete): before issue 47 a JetStream
    acknowledgement a tenant had redirected there made the auditor fail at every start, and full
    verification fail for ever."""
    fill(world.store, 1, 6)
    await world.verifier().tick()  # a head at 5
    before = skipped_heads()
    subject = subjects.auditor_head(world.chain_id)
    await world.js.publish(subject, b'{"stream": "INFER", "seq": 7}', stream=subjects.AUDIT_HEADS_STREAM)
    restarted = world.verifier()
    await restarted.start()
    assert (restarted.status().intact, restarted.status().verified_pos) == (True, 5)
    fill(world.store, 6, 11)
    await restarted.tick()  # signs past the junk
    await restarted.verify_all()
    assert (restarted.status().intact, restarted.status().signed_pos) == (True, 10)
    assert skipped_heads() - before >= 1


def test_the_head_key_is_private_to_its_owner(tmp_path: Path) -> None:
    path = tmp_path / "state" / "auditor-head.key"
    key = load_or_create_key(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    public = (tmp_path / "state" / "auditor-head.key.pub").read_text().strip()
    assert HeadSigner("main", key).public_key == public
    assert HeadSigner("main", load_or_create_key(path)).public_key == public  # kept across restarts
    os.chmod(path, 0o644)
    with pytest.raises(IntegrityError, match="readable by others"):
        load_or_create_key(path)


async def _newest_head(url: str, chain_id: str = "main") -> SignedHead | None:
    nc = await nats.connect(url)
    try:
        return await HeadLog(nc.jetstream(), chain_id).latest()
    finally:
        await nc.close()


def test_a_head_is_signed_every_n_records_and_at_a_graceful_stop(own_nats, tmp_path: Path) -> None:
    """Rows after the newest signed head can be deleted undetected: a head is signed once
    LF_HEAD_EVERY_RECORDS were appended (here before the hour-long interval is up), and again on a
    graceful stop, so no row is left unsigned. Before: only every LF_HEAD_INTERVAL_S."""
    db = tmp_path / "audit.sqlite3"
    env = {
        "LF_NATS_URL": own_nats.url,
        "LF_DB_PATH": str(db),
        "LF_METRICS_PORT": "-1",
        "LF_HEAD_INTERVAL_S": "3600",
        "LF_HEAD_EVERY_RECORDS": "50",
    }
    stack = Stack(env, tmp_path / "logs")
    try:
        stack.start("auditor")
        asyncio.run(publish(own_nats.url, 0, 120))
        wait_count(db, 120)
        deadline = time.monotonic() + 60  # generous: a loaded machine is slow, never wrong
        while (head := asyncio.run(_newest_head(own_nats.url))) is None or head.pos < 100:
            assert time.monotonic() < deadline, f"no head past record 100 of 120 (newest: {head})"
            time.sleep(0.2)
        assert head.pos <= 120  # at most 50 records short of the tip, though the interval never came
        stack.stop("auditor", timeout_s=60)  # SIGTERM: the auditor signs its last records on the way out
        final = asyncio.run(_newest_head(own_nats.url))
        assert final is not None and final.pos == 120
    finally:
        stack.stop_all()


async def test_a_row_rewritten_after_the_newest_head_is_not_signed(world: World) -> None:
    """Issue 47 (LOW): the tail past the newest signed head was re-read from the file and signed as
    found; the head is now signed from the tip the store wrote, so a re-linked edit is never vouched for."""
    verifier = world.verifier()
    fill(world.store, 1, 11)
    await verifier.tick()
    fill(world.store, 11, 16)
    written = world.store_tip()
    assert written.pos == 15
    relink_from(world.path, 13, '"n":13', '"n":99')
    assert world.store.verify() is None  # every link on disk verifies
    forged = world.store_tip()
    assert forged.pos == 15 and forged.hash != written.hash

    await verifier.tick()
    status = verifier.status()
    assert (status.intact, status.broken_at, status.signed_pos) == (False, 11, 10)
    assert status.problem and status.problem.startswith("rewritten")
    head = await HeadLog(world.js, world.chain_id).latest()
    assert head is not None and head.pos == 10 and head.hash != forged.hash
    fill(world.store, 16, 18)  # nothing is signed after the break, and new rows link to what was written
    await verifier.tick()
    assert verifier.status().signed_pos == 10
    with contextlib.closing(world.store.reader()) as db:
        assert db.execute("SELECT prev_hash FROM audit WHERE pos = 16").fetchone()[0] == written.hash


async def test_the_head_covers_exactly_what_the_store_wrote(world: World) -> None:
    verifier = world.verifier()
    fill(world.store, 1, 8)
    await verifier.tick()
    head = await HeadLog(world.js, world.chain_id).latest()
    assert head is not None and world.store.tip is not None
    assert (head.pos, head.hash) == (world.store.tip.pos, world.store.tip.hash) == (7, world.store_tip().hash)
