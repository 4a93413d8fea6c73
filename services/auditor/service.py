"""Auditor process: a durable consumer of the AUDIT stream feeding the hash-chained store,
cross-checking completions against the registry, answering tenant-scoped queries."""

import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from services.auditor.crosscheck import check_completion
from services.auditor.head_log import HeadLog
from services.auditor.heads import HeadSigner, load_or_create_key
from services.auditor.settings import AuditorSettings
from services.auditor.store import AuditStore
from services.auditor.verifier import ChainVerifier
from shared import event_loop, metrics, subjects
from shared.bus import MAX_MESSAGE_BYTES, connect, decode, drain_or_close, ensure_streams, serve, shutdown_event
from shared.catalog.grants import IsolationAttempt
from shared.catalog.view import CatalogView, follow_catalog
from shared.config import load_settings
from shared.errors import (
    IntegrityError,
    InvalidMessage,
    LorafleetError,
    ModelNotFound,
    ServiceUnavailable,
    UpstreamTimeout,
)
from shared.heartbeat import publish_heartbeats
from shared.logs import configure_logging
from shared.metrics_http import serve_metrics
from shared.schemas import (
    AdapterRecord,
    AuditEnvelope,
    AuditQueryReply,
    AuditQueryRequest,
    CompletionAudit,
    RejectionAudit,
)
from shared.telemetry import setup_tracing
from shared.undecodable import skip

log = structlog.get_logger("auditor")
REGISTRY_TIMEOUT_S = 5.0  # its view never resolves a request: the bound of a fallback it does not use
QUEUED = 1024  # AUDIT messages received and not yet recorded; past it the subscription waits


@dataclass(frozen=True, slots=True)
class Records:
    """The registry's records as the cross-check reads them: the auditor's catalog view, else the
    records bucket itself (a version registered a moment ago may not have reached the view yet)."""

    catalog: CatalogView
    js: JetStreamContext

    async def get(self, adapter_id: str, version: int | None) -> AdapterRecord | None:
        """The version's record; None when the registry has none (a completion without a version
        names none)."""
        if version is None:
            return None
        try:
            return await self.catalog.record(self.js, adapter_id, version)
        except ModelNotFound:
            return None
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.errors.ConnectionClosedError) as e:
            raise ServiceUnavailable(f"the records bucket did not answer: {type(e).__name__}") from None


async def _violations(records: Records, event, stop: asyncio.Event) -> list:
    """The cross-check's findings; while the records bucket is unreachable it waits (the stream holds the rest)."""
    if not isinstance(event, CompletionAudit) or event.adapter_id is None:
        return []
    while True:
        try:
            return check_completion(event, await records.get(event.adapter_id, event.adapter_version))
        except (ServiceUnavailable, UpstreamTimeout) as e:
            event_loop.keep_cancel(e)
            log.warning("crosscheck_waiting_for_records", error=e.message)
            if stop.is_set():
                raise
            await asyncio.sleep(1.0)


async def _record(store: AuditStore, records: Records, seq: int, event, stop: asyncio.Event) -> None:
    violations = await _violations(records, event, stop)
    store.append(seq, event.model_dump(mode="json"))
    if isinstance(event, RejectionAudit) and event.code == IsolationAttempt.code:
        metrics.TENANT_ISOLATION_ERRORS.labels(event.route or "unknown").inc()
    for number, violation in enumerate(violations, start=1):
        # a derived record gets a sequence of its own beyond the stream's, so replays stay idempotent
        store.append(-(seq * 10 + number), violation.model_dump(mode="json"))
        if violation.violation == "tenant_isolation":
            metrics.TENANT_ISOLATION_VIOLATIONS.inc()
        else:
            metrics.INTEGRITY_ERRORS.labels("auditor").inc()
        log.error(
            "audit_violation",
            violation=violation.violation,
            request_id=event.request_id,
            tenant_id=event.tenant_id,
            adapter_id=event.adapter_id,
            detail=violation.detail,
        )


REPLY_BUDGET_BYTES = MAX_MESSAGE_BYTES // 2  # records in one reply; the rest are the next page's


async def answer_query(store: AuditStore, verifier: ChainVerifier, query: AuditQueryRequest) -> AuditQueryReply:
    """A page of the records a query names, newest first and never over the reply budget; a
    platform-wide query (no tenant) also says what is known of the chain (``verify``: after
    re-hashing all of it, in a thread)."""
    rows = store.query(
        tenant_id=query.tenant_id,
        request_id=query.request_id,
        adapter_id=query.adapter_id,
        kind=query.kind,
        since=query.since,
        until=query.until,
        before=query.before,
        limit=query.limit + 1,
    )
    records: list[dict] = []
    size = 0
    for row in rows[: query.limit]:
        record = {"pos": row.pos, "hash": row.hash, **row.body}
        size += len(json.dumps(record)) + 1
        if size > REPLY_BUDGET_BYTES and records:
            break
        records.append(record)
    more = len(records) < len(rows)
    reply = AuditQueryReply(records=records, next_cursor=records[-1]["pos"] if more else None)
    if query.tenant_id is None:
        if query.verify:
            await verifier.verify_all()
        reply = reply.model_copy(update={"chain": verifier.status()})
    return reply


async def sign_head(verifier: ChainVerifier) -> None:
    """Verify what was added and sign the new head; a head NATS could not store is signed again next time."""
    try:
        await verifier.tick()
    except Exception as e:  # NATS away: the rows wait, nothing is lost
        log.warning("audit_head_not_published", error=str(e))


async def keep_verifying(verifier: ChainVerifier, interval_s: float, stop: asyncio.Event, due: asyncio.Event) -> None:
    """Verify and sign on a fixed interval, and at once whenever ``due`` is set (enough records
    were appended since the last head), until ``stop``; the head at shutdown is the caller's."""
    while not stop.is_set():
        due.clear()
        await sign_head(verifier)
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(due.wait())]
        await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        for waiting in waits:
            waiting.cancel()


@dataclass(eq=False)
class Auditor:
    """The auditor's wired parts: each bus message is one call of a named handler."""

    store: AuditStore
    records: Records
    verifier: ChainVerifier
    head_every_records: int
    stop: asyncio.Event
    due: asyncio.Event = field(default_factory=asyncio.Event)  # set once enough records wait for a signed head
    _arrived: asyncio.Queue[Msg] = field(default_factory=lambda: asyncio.Queue(maxsize=QUEUED))

    async def serve_queries(self, nc: NATS) -> None:
        await serve(
            nc,
            subjects.AUDITOR_QUERY,
            AuditQueryRequest,
            self.on_query,
            queue="auditor",
            concurrent=True,  # a full verification must not hold up the queries behind it
        )

    async def subscribe(self, js: JetStreamContext) -> int:
        """Follow AUDIT from the record after the last one stored; that stream sequence."""
        # Resume in stream order right after the last recorded sequence: the index is the cursor,
        # so a restart has no gaps, no duplicates and no reordering.
        start = self.store.last_stream_seq() + 1
        await js.subscribe(
            subjects.AUDIT_ALL,
            cb=self.on_audit,
            stream=subjects.AUDIT_STREAM,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        return start

    async def on_query(self, query: AuditQueryRequest) -> AuditQueryReply:
        return await answer_query(self.store, self.verifier, query)

    async def on_audit(self, msg: Msg) -> None:
        await self._arrived.put(msg)

    async def consume(self) -> None:
        """Record what arrives on AUDIT, one message at a time in stream order, until ``stop``."""
        while not self.stop.is_set():
            try:
                msg = await asyncio.wait_for(self._arrived.get(), 0.5)
            except TimeoutError:
                continue
            await self.on_record(msg)

    async def on_record(self, msg: Msg) -> None:
        try:
            event = decode(AuditEnvelope, msg.data).body
            if msg.subject != subjects.audit(event.kind, event.tenant_id):
                # publishers write audit(kind, tenant): anything else on AUDIT (e.g. a JetStream
                # acknowledgement a client redirected there with its reply subject) is not a record
                raise IntegrityError(f"a {event.kind} record of tenant {event.tenant_id!r} on {msg.subject}")
            await _record(self.store, self.records, msg.metadata.sequence.stream, event, self.stop)
            if self.store.last_pos() - self.verifier.signed_pos >= self.head_every_records:
                self.due.set()
        except InvalidMessage as e:  # not a record at all
            skip(subjects.AUDIT_STREAM, msg.subject, e)
        except LorafleetError as e:
            metrics.INTEGRITY_ERRORS.labels("auditor").inc()
            log.warning("bad_audit_record", subject=msg.subject, error=e.message)

    def status(self) -> tuple[bool, str]:
        return True, f"{self.store.last_pos()} records"

    async def drain(self, verifying: asyncio.Task) -> None:
        """Let the verifier finish, sign the head after the last record: a graceful stop leaves no unsigned
        tail (the stack's step after the heartbeats' cancel, before the followers, NATS and the store close)."""
        if self.stop.is_set():
            await verifying  # it ends at its next wait
        else:  # a failed start or a cancelled run: no stop comes to end it
            await event_loop.cancel_all([verifying])
        await sign_head(self.verifier)
        log.info("auditor_stopped", records=self.store.last_pos(), signed_pos=self.verifier.signed_pos)


async def run(settings: AuditorSettings, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (default: SIGTERM or SIGINT), then drain."""
    configure_logging("auditor", settings.log_level)
    setup_tracing("auditor", settings.trace_exporter)
    store = AuditStore(settings.db_path)
    key_path = Path(settings.key_path) if settings.key_path else Path(settings.db_path).with_name("auditor-head.key")
    signer = HeadSigner(settings.chain_id, load_or_create_key(key_path))
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(store.close)
        nc = await connect(settings.nats_url, f"auditor-{settings.instance_id}")
        stack.push_async_callback(drain_or_close, nc)
        js = nc.jetstream()
        await ensure_streams(js)
        followed = await follow_catalog(nc, REGISTRY_TIMEOUT_S)  # the registry's records, for the cross-check
        stack.callback(followed.stop)
        verifier = ChainVerifier(store, signer, HeadLog(js, settings.chain_id))
        await verifier.start()
        stop = stop or shutdown_event()
        auditor = Auditor(store, Records(followed.view, js), verifier, settings.head_every_records, stop)
        await auditor.serve_queries(nc)
        verifying = asyncio.create_task(keep_verifying(verifier, settings.head_interval_s, stop, auditor.due))
        stack.push_async_callback(auditor.drain, verifying)  # unwound after everything entered below
        start = await auditor.subscribe(js)
        metrics_port = stack.enter_context(
            serve_metrics(settings.metrics_port, settings.metrics_host, settings.metrics_bearer())
        ).port
        beats = asyncio.create_task(
            publish_heartbeats(
                nc, "auditor", settings.instance_id, settings.heartbeat_interval_s, auditor.status, metrics_port
            )
        )
        stack.push_async_callback(event_loop.cancel_all, [beats])
        log.info("auditor_started", records=store.last_pos(), resume_from=start, head_key=signer.public_key)
        await auditor.consume()


def main() -> None:
    event_loop.run(run(load_settings(AuditorSettings, sys.argv[1:])))
