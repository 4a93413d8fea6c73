"""The scheduler service's handlers (``services.scheduler.service.Scheduler``), one bus message or
tick each, around a real Dispatcher on a real Redis: what they change, what they export on
/metrics, and that a bad message is logged, never raised into the subscription."""

import itertools
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.scheduler.service import Scheduler
from services.scheduler.settings import SchedulerSettings
from shared import subjects
from shared.bus import encode
from shared.redis_conn import connect_redis
from shared.schemas import AuditEnvelope, InferRequest, WorkerControl, WorkerHeartbeat
from tests.scheduler.test_dispatcher import BASE, Msg, World, completion_audit


@dataclass
class Bus:
    is_connected: bool = True


class Delivery(Msg):
    """A message as the handlers get it: subject and body, plus the JetStream acts of Msg."""

    sequence = itertools.count(1)

    def __init__(self, data: bytes, subject: str = "") -> None:
        super().__init__()
        self.data, self.subject = data, subject
        # JetStream's metadata, as nats-py parses it from the reply subject: the stream sequence and
        # when the stream stored it
        self.metadata = SimpleNamespace(
            sequence=SimpleNamespace(stream=next(self.sequence)), timestamp=datetime.now(UTC)
        )


@pytest.fixture
async def wired(redis_url):
    redis = connect_redis(redis_url)
    settings = SchedulerSettings(capacity_headroom=0, redis_key_prefix=f"h{time.monotonic_ns()}:")
    world = World(settings, redis)
    yield world, Scheduler(Bus(), world.core, world.upkeep, max_inflight=8)  # type: ignore[arg-type]
    await redis.aclose()


def beat(worker_id: str, max_running: int = 1) -> Delivery:
    return Delivery(
        encode(
            WorkerHeartbeat(
                worker_id=worker_id,
                base_model=BASE,
                ready=True,
                running=0,
                waiting=0,
                max_running=max_running,
                kv_blocks_free=10,
                kv_blocks_total=10,
                ts=time.time(),
            )
        )
    )


def submission(rid: str) -> Delivery:
    request = InferRequest(
        request_id=rid, tenant_id="acme", model=BASE, base_model=BASE, prompt="hi", reply_to="_INBOX.x"
    )
    return Delivery(encode(request), subjects.infer_submit("acme", subjects.VIA_GATEWAY))


def completion(rid: str, worker_id: str) -> Delivery:
    return Delivery(encode(AuditEnvelope(body=completion_audit(rid, worker_id))))


def inflight_gauge(worker_id: str) -> float | None:
    return REGISTRY.get_sample_value("scheduler_worker_inflight", {"worker": worker_id})


async def test_messages_place_and_end_requests_and_the_ticks_export_each_workers_inflight(wired):
    world, scheduler = wired
    assert scheduler.status() == (False, "learning the fleet from heartbeats (0 workers, 0 queued)")
    scheduler.discovered = True  # run() sets it once it has listened to the heartbeats
    await scheduler.on_heartbeat(beat("hw1"))
    first, second = submission("a"), submission("b")
    await scheduler.on_submission(first)
    await scheduler.on_submission(second)  # hw1 runs one at a time: b waits here
    await world.settle()
    assert first.acts == ["ack"] and second.acts == [] and world.dispatched == [("hw1", "a")]
    await scheduler.on_tick()
    assert inflight_gauge("hw1") == 1 and scheduler.status() == (True, "1 workers, 1 queued")

    await scheduler.on_cancel(Delivery(encode(WorkerControl(action="cancel", request_id="b", tenant_id="acme"))))
    assert second.acts == ["term"]
    await scheduler.on_completion(completion("a", "hw1"))
    await scheduler.on_tick()
    assert inflight_gauge("hw1") == 0 and not world.core.inflight

    world.core.fleet.workers["hw1"].seen_at -= 60  # silent: dropped, and so is its gauge
    await scheduler.on_tick()
    assert "hw1" not in world.core.fleet.workers and inflight_gauge("hw1") is None


async def test_a_bad_message_is_logged_and_changes_nothing(wired):
    world, scheduler = wired
    for handler in (scheduler.on_heartbeat, scheduler.on_completion, scheduler.on_cancel):
        await handler(Delivery(b"{not json"))
    garbled = Delivery(b"{not json", "lf.infer.submit.acme")
    await scheduler.on_submission(garbled)
    assert garbled.acts == ["term"] and not world.core.fleet.workers and not world.core.held
