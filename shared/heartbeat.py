"""Publish a service's liveness on ``lf.service.heartbeat.<service>`` until told to stop."""

import asyncio
from collections.abc import Callable, Sequence

import structlog
from nats.aio.client import Client as NATS

from shared import subjects
from shared.bus import encode
from shared.event_loop import keep_cancel
from shared.schemas import ServiceHeartbeat, WorkerPhase

log = structlog.get_logger("heartbeat")


async def publish_heartbeats(
    nc: NATS,
    service: str,
    instance_id: str,
    interval_s: float,
    status: Callable[[], tuple[bool, str]],
    metrics_port: int | None = None,
    checks_off: Sequence[str] = (),
    phase: Callable[[], WorkerPhase] | None = None,
) -> None:
    """Every ``interval_s``: publish (ready, detail) from ``status()`` (and a worker's ``phase()``), and
    the safety checks this instance runs without (``checks_off``). Runs until cancelled."""
    subject = subjects.service_heartbeat(service)
    while True:
        ready, detail = status()
        if nc.is_connected:
            try:
                beat = ServiceHeartbeat(
                    service=service,
                    instance_id=instance_id,
                    ready=ready,
                    detail=detail[:500],
                    metrics_port=metrics_port,
                    checks_off=list(checks_off),
                    phase=phase() if phase else None,
                )
                await nc.publish(subject, encode(beat))
            except Exception as e:  # liveness must never take the service down
                keep_cancel(e)
                log.warning("heartbeat_failed", error=str(e))
        await asyncio.sleep(interval_s)
