"""Auditor process: a durable consumer of the AUDIT stream feeding the hash-chained store."""

import asyncio
import contextlib

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.auditor.store import AuditStore
from shared import subjects
from shared.bus import connect, decode, ensure_streams, shutdown_event
from shared.config import AuditorSettings
from shared.errors import LorafleetError
from shared.heartbeat import publish_heartbeats
from shared.metrics import serve_metrics
from shared.logs import configure_logging
from shared.telemetry import setup_tracing
from shared.schemas import AuditEnvelope


async def run(settings: AuditorSettings) -> None:
    log = configure_logging("auditor", settings.log_level)
    setup_tracing("auditor", settings.trace_exporter)
    store = AuditStore(settings.db_path)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(store.close)
        nc = await connect(settings.nats_url, f"auditor-{settings.instance_id}")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        psub = await js.pull_subscribe(
            subjects.AUDIT_ALL, durable=settings.durable_name, stream=subjects.AUDIT_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30),
        )
        stop = shutdown_event()
        metrics_port = serve_metrics(settings.metrics_port, settings.metrics_host)
        beats = asyncio.create_task(publish_heartbeats(
            nc, "auditor", settings.instance_id, settings.heartbeat_interval_s,
            lambda: (True, f"{store.count()} records"), metrics_port))
        log.info("auditor_started", records=store.count())
        while not stop.is_set():
            try:
                msgs = await psub.fetch(batch=64, timeout=0.5)
            except NatsTimeout:
                continue
            except Exception as e:
                log.warning("fetch_failed", error=str(e))
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    event = decode(AuditEnvelope, msg.data).body
                    store.append(msg.metadata.sequence.stream, event.model_dump(mode="json"))
                except LorafleetError as e:
                    log.warning("bad_audit_record", subject=msg.subject, error=e.message)
                await msg.ack()
        beats.cancel()
        log.info("auditor_stopped", records=store.count())


def main() -> None:
    asyncio.run(run(AuditorSettings()))
