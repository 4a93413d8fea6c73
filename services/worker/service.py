"""Worker process: load the base model, run the engine, answer dispatches, stream replies."""

import asyncio
import contextlib
from pathlib import Path

import structlog
from nats.aio.client import Client as NATS

from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.config import EngineConfig
from services.worker.model_loader import load_model
from services.worker.serving import RequestServer
from shared import metrics, subjects
from shared.bus import connect, decode, encode, ensure_streams, reply_error, shutdown_event
from shared.config import WorkerSettings
from shared.errors import LorafleetError
from shared.heartbeat import publish_heartbeats
from shared.logs import configure_logging
from shared.telemetry import continued, setup_tracing, tracer
from shared.schemas import (
    AuditEnvelope, CompletionAudit, DispatchReply, InferRequest, ReplyEnvelope, ReplyMessage, WorkerControl,
    WorkerHeartbeat,
)

log = structlog.get_logger("worker")


async def _worker_heartbeats(nc: NATS, server: RequestServer, settings: WorkerSettings, base_model: str) -> None:
    while True:
        stats = server.engine.stats()
        metrics.RUNNING.set(stats.running)
        metrics.QUEUE_DEPTH.labels("worker").set(stats.waiting)
        metrics.KV_USAGE.set(1 - stats.kv_blocks_free / max(1, stats.kv_blocks_total))
        beat = WorkerHeartbeat(worker_id=settings.worker_id, base_model=base_model, ready=True,
                               running=stats.running, waiting=stats.waiting, max_running=settings.max_running,
                               kv_blocks_free=stats.kv_blocks_free, kv_blocks_total=stats.kv_blocks_total)
        if nc.is_connected:
            with contextlib.suppress(Exception):
                await nc.publish(subjects.WORKER_HEARTBEAT, encode(beat))
        await asyncio.sleep(settings.heartbeat_interval_s)


async def run(settings: WorkerSettings) -> None:
    configure_logging("worker", settings.log_level)
    setup_tracing("worker", settings.trace_exporter)
    span_tracer = tracer("worker")
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"worker-{settings.worker_id}")
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js)
        stop = shutdown_event()
        metrics_port = metrics.serve_metrics(settings.metrics_port, settings.metrics_host)
        loading = {"ready": False, "detail": "loading base model"}
        beats = asyncio.create_task(publish_heartbeats(
            nc, "worker", settings.worker_id, settings.heartbeat_interval_s,
            lambda: (loading["ready"], loading["detail"]), metrics_port))
        cache_dir = Path(settings.model_cache) if settings.model_cache else None
        loaded = await asyncio.to_thread(load_model, settings.model_dir, device=settings.device, cache_dir=cache_dir)
        config = EngineConfig(device=settings.device, dtype=settings.dtype, max_num_seqs=settings.max_running)
        engine = AsyncEngine.from_loaded(loaded, config)
        engine.start()
        stack.callback(engine.shutdown)

        async def emit(reply_to: str, message: ReplyMessage) -> None:
            await nc.publish(reply_to, encode(ReplyEnvelope(body=message)))

        async def audit(event: CompletionAudit) -> None:
            try:
                await js.publish(subjects.audit("completion", event.tenant_id), encode(AuditEnvelope(body=event)))
            except Exception as e:
                log.warning("audit_publish_failed", request_id=event.request_id, error=str(e))

        server = RequestServer(engine, loaded.tokenizer, settings.worker_id, loaded.name, emit, audit,
                               max_waiting=settings.max_running * 4)

        async def on_dispatch(msg) -> None:
            try:
                request = decode(InferRequest, msg.data)
                with continued(msg.headers), span_tracer.start_as_current_span(
                        "worker.accept", attributes={"lf.request_id": request.request_id}):
                    await server.accept(request)
                reply = DispatchReply(accepted=True, worker_id=settings.worker_id)
            except LorafleetError as e:
                log.info("dispatch_refused", error=e.message, code=e.code)
                reply = DispatchReply(accepted=False, worker_id=settings.worker_id, error=e.to_body())
            if msg.reply:
                await nc.publish(msg.reply, encode(reply))

        async def on_control(msg) -> None:
            try:
                control = decode(WorkerControl, msg.data)
            except LorafleetError as e:
                log.warning("bad_control_message", error=e.message)
                if msg.reply:
                    await reply_error(nc, msg.reply, e)
                return
            if control.action == "cancel":
                server.cancel(control.request_id)

        await nc.subscribe(subjects.worker_dispatch(settings.worker_id), cb=on_dispatch)
        await nc.subscribe(subjects.worker_control(settings.worker_id), cb=on_control)
        hb = asyncio.create_task(_worker_heartbeats(nc, server, settings, loaded.name))
        loading.update(ready=True, detail="")
        log.info("worker_ready", worker_id=settings.worker_id, model=loaded.name)
        await stop.wait()
        loading.update(ready=False, detail="draining")
        hb.cancel()
        if server.tasks:
            await asyncio.wait(list(server.tasks.values()), timeout=10)
        beats.cancel()
        log.info("worker_stopped")


def main() -> None:
    asyncio.run(run(WorkerSettings()))
