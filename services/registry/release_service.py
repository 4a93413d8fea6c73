"""The release controller's wiring: its KV bucket, the AUDIT records it follows, its tick loop."""

import asyncio
import datetime
import functools
from typing import Protocol

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from services.registry.gate import GatePolicy
from services.registry.kv import publish_registry_audit
from services.registry.live_stats import LiveStats
from services.registry.ops import Registry
from services.registry.release_controller import ControllerConfig, ReleaseController
from services.registry.release_policy import ReleasePolicy
from services.registry.releases_kv import ReleasesKV
from services.registry.settings import RegistrySettings
from shared import subjects
from shared.bus import FOLLOW_HEARTBEAT_S, decode
from shared.errors import LorafleetError
from shared.event_loop import keep_cancel
from shared.schemas import AuditEnvelope, CompletionAudit, FeedbackAudit
from shared.undecodable import skip

log = structlog.get_logger("registry.release")


class AuditFollower(Protocol):
    def add_completion(self, record: CompletionAudit) -> None: ...
    def add_feedback(self, record: FeedbackAudit) -> None: ...


async def follow_since(js: JetStreamContext, subject: str, since: float, stats: AuditFollower) -> None:
    """Feed ``stats`` every completion or feedback record stored on ``subject`` from ``since`` on."""

    async def on_message(msg: Msg) -> None:
        try:
            body = decode(AuditEnvelope, msg.data).body
        except LorafleetError as e:
            skip(subjects.AUDIT_STREAM, msg.subject, e)
            return
        if isinstance(body, CompletionAudit):
            stats.add_completion(body)
        elif isinstance(body, FeedbackAudit):
            stats.add_feedback(body)

    start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
    await js.subscribe(
        subject,
        stream=subjects.AUDIT_STREAM,
        cb=on_message,
        ordered_consumer=True,
        idle_heartbeat=FOLLOW_HEARTBEAT_S,
        deliver_policy=DeliverPolicy.BY_START_TIME,
        config=ConsumerConfig(opt_start_time=start),
    )


async def start_controller(nc: NATS, settings: RegistrySettings, registry: Registry) -> ReleaseController:
    """Open the rollouts, replay the live records of their current steps, and return the controller."""
    js = nc.jetstream()

    stats = LiveStats()
    controller = ReleaseController(
        registry,
        await ReleasesKV.open(js),
        stats,
        ReleasePolicy.from_settings(settings),
        ControllerConfig(
            instance_id=settings.instance_id,
            steps=settings.release_steps,
            gate=GatePolicy(
                require_eval=settings.release_gate,
                min_score=settings.release_min_score,
                max_regression=settings.release_max_regression,
            ),
            lease_s=settings.release_lease_s,
        ),
        functools.partial(publish_registry_audit, js),
    )
    since = await controller.window_start()
    for subject in (subjects.AUDIT_COMPLETION_ALL, subjects.AUDIT_FEEDBACK_ALL):
        await follow_since(js, subject, since, stats)
    return controller


async def drive_releases(controller: ReleaseController, tick_s: float) -> None:
    """Tick the controller until cancelled; a failed tick is logged and the next one tries again."""
    while True:
        try:
            await controller.tick()
        except Exception as e:  # a KV or bus outage must not end the loop that rolls bad versions back
            keep_cancel(e)
            log.exception("release_tick_failed")
        await asyncio.sleep(tick_s)
