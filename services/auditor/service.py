"""Auditor process: a durable consumer of the AUDIT stream feeding the hash-chained store,
cross-checking completions against the registry, answering tenant-scoped queries."""

import asyncio
import contextlib
from functools import partial

import structlog
from nats.aio.client import Client as NATS
from nats.js.api import ConsumerConfig, DeliverPolicy

from services.auditor.crosscheck import check_completion
from services.auditor.store import AuditStore
from shared import event_loop, metrics, subjects
from shared.bus import connect, decode, ensure_streams, serve, shutdown_event
from shared.config import AuditorSettings, load_settings
from shared.errors import LorafleetError, ModelNotFound, ServiceUnavailable, UpstreamTimeout
from shared.heartbeat import publish_heartbeats
from shared.logs import configure_logging
from shared.registry_client import fetch_record
from shared.schemas import AdapterRecord, AuditEnvelope, AuditQueryReply, AuditQueryRequest, CompletionAudit
from shared.telemetry import setup_tracing

log = structlog.get_logger("auditor")


class RecordCache:
    """Registry records by (adapter, version): versions are immutable, so a record never goes stale
    for what the cross-check compares (owner, scopes, checksum)."""

    def __init__(self, nc: NATS, timeout_s: float = 5.0):
        self._nc = nc
        self._timeout_s = timeout_s
        self._records: dict[tuple[str, int | None], AdapterRecord | None] = {}

    async def get(self, adapter_id: str, version: int | None) -> AdapterRecord | None:
        key = (adapter_id, version)
        if key not in self._records:
            try:
                self._records[key] = await fetch_record(self._nc, adapter_id, version, self._timeout_s)
            except ModelNotFound:
                self._records[key] = None
        return self._records[key]


async def _violations(records: RecordCache, event, stop: asyncio.Event) -> list:
    """The cross-check's findings; while the registry is unreachable it waits (the stream holds the rest)."""
    if not isinstance(event, CompletionAudit) or event.adapter_id is None:
        return []
    while True:
        try:
            return check_completion(event, await records.get(event.adapter_id, event.adapter_version))
        except (ServiceUnavailable, UpstreamTimeout) as e:
            log.warning("crosscheck_waiting_for_registry", error=e.message)
            if stop.is_set():
                raise
            await asyncio.sleep(1.0)


async def _record(store: AuditStore, records: RecordCache, seq: int, event, stop: asyncio.Event) -> None:
    violations = await _violations(records, event, stop)
    store.append(seq, event.model_dump(mode="json"))
    for number, violation in enumerate(violations, start=1):
        # a derived record gets a sequence of its own beyond the stream's, so replays stay idempotent
        store.append(-(seq * 10 + number), violation.model_dump(mode="json"))
        if violation.violation == "tenant_isolation":
            metrics.TENANT_ISOLATION_ERRORS.inc()
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


async def answer_query(store: AuditStore, query: AuditQueryRequest) -> AuditQueryReply:
    """The records a query names; a platform-wide query (no tenant) also proves the whole chain."""
    rows = store.query(
        tenant_id=query.tenant_id,
        request_id=query.request_id,
        adapter_id=query.adapter_id,
        kind=query.kind,
        since=query.since,
        until=query.until,
        limit=query.limit,
    )
    reply = AuditQueryReply(records=[{"pos": r.pos, "hash": r.hash, **r.body} for r in rows])
    if query.tenant_id is None:
        broken = store.verify()
        reply = reply.model_copy(update={"intact": broken is None, "broken_at": broken, "count": store.count()})
    return reply


async def run(settings: AuditorSettings) -> None:
    configure_logging("auditor", settings.log_level)
    setup_tracing("auditor", settings.trace_exporter)
    store = AuditStore(settings.db_path)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(store.close)
        nc = await connect(settings.nats_url, f"auditor-{settings.instance_id}")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        records = RecordCache(nc)

        await serve(nc, subjects.AUDITOR_QUERY, AuditQueryRequest, partial(answer_query, store), queue="auditor")
        stop = shutdown_event()
        queue: asyncio.Queue = asyncio.Queue(maxsize=1024)

        async def on_audit(msg) -> None:
            await queue.put(msg)

        # Resume in stream order right after the last recorded sequence: the index is the cursor,
        # so a restart has no gaps, no duplicates and no reordering.
        start = store.last_stream_seq() + 1
        await js.subscribe(
            subjects.AUDIT_ALL,
            cb=on_audit,
            stream=subjects.AUDIT_STREAM,
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        metrics_port = metrics.serve_metrics(settings.metrics_port, settings.metrics_host)
        beats = asyncio.create_task(
            publish_heartbeats(
                nc,
                "auditor",
                settings.instance_id,
                settings.heartbeat_interval_s,
                lambda: (True, f"{store.count()} records"),
                metrics_port,
            )
        )
        log.info("auditor_started", records=store.count(), resume_from=start)
        while not stop.is_set():
            try:
                msg = await asyncio.wait_for(queue.get(), 0.5)
            except TimeoutError:
                continue
            try:
                await _record(store, records, msg.metadata.sequence.stream, decode(AuditEnvelope, msg.data).body, stop)
            except LorafleetError as e:
                log.warning("bad_audit_record", subject=msg.subject, error=e.message)
        beats.cancel()
        log.info("auditor_stopped", records=store.count())


def main() -> None:
    event_loop.run(run(load_settings(AuditorSettings)))
