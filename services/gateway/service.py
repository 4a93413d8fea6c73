"""Gateway process: connect to NATS, follow the cluster's heartbeats, serve HTTP."""

import asyncio
import contextlib
import sys
from dataclasses import dataclass

import structlog
import uvicorn
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

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

log = structlog.get_logger(service="gateway")  # as configure_logging binds it


@dataclass(eq=False)
class Gateway:
    """What the gateway follows on the bus for /readyz: each message is one call of a named handler."""

    nc: NATS
    cluster: ClusterView
    keys: ApiKeys
    server: uvicorn.Server | None = None  # the HTTP server, once built

    async def subscribe(self) -> None:
        await self.nc.subscribe(subjects.SERVICE_HEARTBEAT_ALL, cb=self.on_service)
        await self.nc.subscribe(subjects.WORKER_HEARTBEAT, cb=self.on_worker)
        await self.nc.subscribe(subjects.SUPERVISOR_STATUS, cb=self.on_supervisor)

    async def on_service(self, msg: Msg) -> None:
        try:
            self.cluster.on_service(decode(ServiceHeartbeat, msg.data))
        except Exception as e:
            log.warning("bad_heartbeat", error=str(e))

    async def on_worker(self, msg: Msg) -> None:
        try:
            self.cluster.on_worker(decode(WorkerHeartbeat, msg.data))
        except Exception as e:
            log.warning("bad_heartbeat", error=str(e))

    async def on_supervisor(self, msg: Msg) -> None:
        try:
            self.cluster.on_supervisor(decode(SupervisorStatus, msg.data))
        except Exception as e:
            log.warning("bad_supervisor_status", error=str(e))

    def health(self) -> tuple[bool, str]:
        started = self.server is not None and self.server.started
        return started and self.keys.loaded, "" if self.keys.loaded else "loading API keys"

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve HTTP until ``stop`` (or until the server stops by itself), then let it finish."""
        assert self.server is not None, "serve() after the server is built"
        serving = asyncio.create_task(self.server.serve())
        log.info("gateway_started", port=self.server.config.port)
        await asyncio.wait([serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        self.server.should_exit = True
        await serving


def http_server(settings: GatewaySettings, ctx: GatewayContext) -> uvicorn.Server:
    # h11 even where httptools is installed: httptools answers a header holding a control byte
    # with its own plain-text 400 before the app can give its typed, OpenAI-style error.
    return uvicorn.Server(
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


async def run(settings: GatewaySettings) -> None:
    configure_logging("gateway", settings.log_level)
    setup_tracing("gateway", settings.trace_exporter)
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(settings.nats_url, f"gateway-{settings.instance_id}")
        stack.push_async_callback(drain_or_close, nc)
        js = nc.jetstream()
        await ensure_streams(js)
        gateway = Gateway(
            nc, ClusterView(settings.liveness_timeout_s), ApiKeys(settings.api_keys, settings.default_quota.slo_tier)
        )
        await gateway.subscribe()
        tokens = None
        if settings.max_prompt_tokens:
            tokens = await asyncio.to_thread(lambda: PromptTokens.load(resolve_model_dir(settings.model_dir)))
        watch = asyncio.create_task(follow_keys(nc, gateway.keys))
        stack.push_async_callback(event_loop.cancel_all, [watch])
        followed = await follow_catalog(
            nc, settings.registry_timeout_s, barrier=("gateway", settings.instance_id), routing=True
        )
        stack.callback(followed.stop)
        ctx = GatewayContext(settings, nc, js, gateway.cluster, gateway.keys, followed.view, tokens)
        gateway.server = http_server(settings, ctx)
        stop = shutdown_event()
        stack.callback(log.info, "gateway_stopped")  # unwound after the heartbeats stop, before the followers
        beats = asyncio.create_task(
            publish_heartbeats(nc, "gateway", settings.instance_id, settings.heartbeat_interval_s, gateway.health)
        )
        stack.push_async_callback(event_loop.cancel_all, [beats])
        await gateway.serve(stop)


def main() -> None:
    event_loop.run(run(load_settings(GatewaySettings, sys.argv[1:])))
