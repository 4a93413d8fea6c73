"""Gateway process: connect to NATS, follow the cluster's heartbeats, serve HTTP."""

import asyncio
import contextlib
import sys

import uvicorn

from services.gateway.app import create_app
from services.gateway.auth import ApiKeys
from services.gateway.context import GatewayContext
from services.gateway.key_watch import follow_keys
from services.gateway.readiness import ClusterView
from services.gateway.settings import GatewaySettings
from shared import event_loop, subjects
from shared.base_model import resolve_model_dir
from shared.bus import connect, decode, drain_or_close, ensure_streams, shutdown_event
from shared.catalog.view import follow_catalog
from shared.config import load_settings
from shared.heartbeat import publish_heartbeats
from shared.logs import configure_logging
from shared.prompt_tokens import PromptTokens
from shared.schemas import ServiceHeartbeat, SupervisorStatus, WorkerHeartbeat
from shared.telemetry import setup_tracing


async def run(settings: GatewaySettings) -> None:
    log = configure_logging("gateway", settings.log_level)
    setup_tracing("gateway", settings.trace_exporter)
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"gateway-{settings.instance_id}")
        stack.push_async_callback(drain_or_close, nc)
        js = nc.jetstream()
        await ensure_streams(js)
        cluster = ClusterView(settings.liveness_timeout_s)

        async def on_service(msg) -> None:
            try:
                cluster.on_service(decode(ServiceHeartbeat, msg.data))
            except Exception as e:
                log.warning("bad_heartbeat", error=str(e))

        async def on_worker(msg) -> None:
            try:
                cluster.on_worker(decode(WorkerHeartbeat, msg.data))
            except Exception as e:
                log.warning("bad_heartbeat", error=str(e))

        async def on_supervisor(msg) -> None:
            try:
                cluster.on_supervisor(decode(SupervisorStatus, msg.data))
            except Exception as e:
                log.warning("bad_supervisor_status", error=str(e))

        await nc.subscribe(subjects.SERVICE_HEARTBEAT_ALL, cb=on_service)
        await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=on_worker)
        await nc.subscribe(subjects.SUPERVISOR_STATUS, cb=on_supervisor)
        tokens = None
        if settings.max_prompt_tokens:
            tokens = await asyncio.to_thread(lambda: PromptTokens.load(resolve_model_dir(settings.model_dir)))
        keys = ApiKeys(settings.api_keys)
        watch = asyncio.create_task(follow_keys(nc, keys))
        stack.callback(watch.cancel)
        followed = await follow_catalog(
            nc, settings.registry_timeout_s, barrier=("gateway", settings.instance_id), routing=True
        )
        stack.callback(followed.stop)
        ctx = GatewayContext(settings, nc, js, cluster, keys, followed.view, tokens)
        # h11 even where httptools is installed: httptools answers a header holding a control byte
        # with its own plain-text 400 before the app can give its typed, OpenAI-style error.
        server = uvicorn.Server(
            uvicorn.Config(
                create_app(ctx),
                host=settings.host,
                port=settings.port,
                log_level="warning",
                lifespan="off",
                http="h11",
                # annotated int, but uvicorn only hands it to loop.call_later, which takes seconds as a float
                timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
            )
        )
        stop = shutdown_event()

        def health() -> tuple[bool, str]:
            return server.started and keys.loaded, "" if keys.loaded else "loading API keys"

        beats = asyncio.create_task(
            publish_heartbeats(nc, "gateway", settings.instance_id, settings.heartbeat_interval_s, health)
        )
        serving = asyncio.create_task(server.serve())
        log.info("gateway_started", port=settings.port)
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await serving
        beats.cancel()
        log.info("gateway_stopped")


def main() -> None:
    event_loop.run(run(load_settings(GatewaySettings, sys.argv[1:])))
