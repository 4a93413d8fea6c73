"""The container health probe: ready only on a recent ready heartbeat of the matching instance."""

import asyncio

import pytest

from lorafleet.cli.healthcheck import instance_matcher, ready_heartbeat
from shared.bus import connect
from shared.heartbeat import publish_heartbeats


@pytest.fixture
def as_scheduler(auth_server, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    monkeypatch.setenv("LF_NATS_URL", auth_server.server.url)
    monkeypatch.setenv("LF_NATS_USER", "scheduler")
    monkeypatch.setenv("LF_NATS_PASSWORD", auth_server.password("scheduler"))
    return "scheduler", auth_server.password("scheduler")


async def test_probe_follows_the_heartbeats_of_its_instance(auth_server, as_scheduler) -> None:
    nc = await connect(auth_server.server.url, "beats", as_scheduler)
    state = {"ready": False}

    def status() -> tuple[bool, str]:
        return state["ready"], "" if state["ready"] else "discovering workers"

    beats = asyncio.create_task(publish_heartbeats(nc, "scheduler", "sched-1", 0.1, status))
    try:
        # not ready: what the instance says it is doing
        assert await ready_heartbeat("scheduler", "sched-1", True, 1.5) == (False, "sched-1 discovering workers")
        state["ready"] = True
        assert await ready_heartbeat("scheduler", "sched-1", True, 2) == (True, "")
        assert await ready_heartbeat("scheduler", "sched", False, 2) == (True, "")
        assert await ready_heartbeat("scheduler", "sched-2", True, 0.5) == (False, "")  # nothing heard of it
    finally:
        beats.cancel()
        await nc.close()


def test_instance_matcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LF_WORKER_ID", "gpu-7")
    assert instance_matcher("worker", False) == ("gpu-7", True)
    monkeypatch.setenv("LF_INSTANCE_ID", "sched-a")
    assert instance_matcher("scheduler", False) == ("sched-a", True)
    monkeypatch.delenv("LF_INSTANCE_ID")
    match, exact = instance_matcher("scheduler", False)
    assert not exact and match.endswith("-")
    assert instance_matcher("auditor", True) == ("", False)
