"""The release controller in the registry process, fed by steady synthetic traffic on the AUDIT
stream (completion records split between the versions as the gateways split them): a good version
is released, a bad one rolled back with no CLI process running, and a registry killed mid-rollout
is replaced by another that carries the rollout on. Each step needs samples, not seconds of a
particular machine: the bounds below are deadlines, the decisions wait for sample counts."""

import asyncio
import base64
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from lorafleet.cli.stack import Stack
from shared import subjects
from shared.bus import connect, encode, request
from shared.catalog.rollout import choose
from shared.errors import LorafleetError
from shared.schemas import (
    AdapterRecord,
    AdapterRecordsReply,
    AuditEnvelope,
    CompletionAudit,
    GetAdapterRequest,
    PromoteRequest,
    RegisterRequest,
    ReleaseStartRequest,
    ReleaseState,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    ServiceHeartbeat,
)

SETTINGS = {
    "LF_RELEASE_MIN_SAMPLES": "15",
    "LF_RELEASE_GUARD_MIN_SAMPLES": "15",
    "LF_RELEASE_DWELL_S": "1",
    "LF_RELEASE_TICK_S": "0.2",
    "LF_RELEASE_LEASE_S": "2",
}
DEADLINE_S = 90.0  # far past what each step needs at the traffic rate below, on a loaded machine
START_S = 60.0  # a registry process's start, on a loaded machine
BATCH = 40  # completion records published per round of traffic (<= 800/s: a loaded registry keeps up)
PAUSE_S = 0.05
BUDGET_S = 2 * START_S + 2 * DEADLINE_S  # one test's waits together, from its fixture's start
# past the budget, so a stalled wait fails with its own message and the logs (each wait ends by the budget)
pytestmark = pytest.mark.timeout(BUDGET_S + 60)
Behaviour = Callable[[int, int], dict]


@dataclass
class Traffic:
    """Completion records at a steady pace, each version chosen by the catalog's split."""

    nc: NATS
    behaviour: Behaviour
    records: list[AdapterRecord] = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)

    async def follow_catalog(self) -> None:
        while True:
            with contextlib.suppress(LorafleetError):  # the registry may be down: gateways keep their split
                reply = await request(
                    self.nc, subjects.registry("get"), GetAdapterRequest(adapter_id="sea"), AdapterRecordsReply, 2
                )
                self.records = reply.records
            await asyncio.sleep(0.1)

    async def run(self) -> None:
        js = self.nc.jetstream()
        while True:
            production = next((r for r in self.records if r.status == "production"), None)
            canary = next((r for r in self.records if r.status == "canary"), None)
            if production is None and canary is None:
                await asyncio.sleep(0.05)
                continue
            acks = []
            for _ in range(BATCH):
                i = next(self.counter)
                served = choose(production, canary, f"user-{i}")
                assert served is not None
                fields = {
                    "ttft_ms": 40.0 + i % 20,
                    "tpot_ms": 8.0 + i % 5,
                    "completion_tokens": 12,
                    "engine_s": 0.024,
                    "outcome": "stop",
                }
                fields.update(self.behaviour(served.version, i))
                record = CompletionAudit(
                    request_id=f"req-{i}",
                    tenant_id="acme",
                    base_model="tiny-llama",
                    adapter_id="sea",
                    adapter_version=served.version,
                    cache_hit=True,
                    prompt_tokens=20,
                    worker_id="w1",
                    **fields,
                )
                acks.append(js.publish(subjects.audit("completion", "acme"), encode(AuditEnvelope(body=record))))
            await asyncio.gather(*acks)
            await asyncio.sleep(PAUSE_S)


@dataclass
class Live:
    stack: Stack
    nc: NATS
    ends: float = field(default_factory=lambda: time.monotonic() + BUDGET_S)

    def deadline(self, wait_s: float) -> float:
        """``wait_s`` from now, or the test's budget's end if sooner."""
        return min(time.monotonic() + wait_s, self.ends)

    async def start_registry(self, instance: str) -> None:
        beats = await self.nc.subscribe(subjects.service_heartbeat("registry"))
        self.stack.start("registry", {"LF_INSTANCE_ID": instance}, key=instance)
        deadline = self.deadline(START_S)
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"registry {instance} not ready in time\n{self.log_tails()}"
            with contextlib.suppress(TimeoutError):
                beat = ServiceHeartbeat.model_validate_json((await beats.next_msg(timeout=left)).data)
                if beat.instance_id == instance and beat.ready:
                    break
        await beats.unsubscribe()

    def log_tails(self, lines: int = 30) -> str:
        """The end of every registry's log: what a failed wait shows."""
        return "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
            for log in sorted(self.stack.log_dir.glob("*.log"))
        )

    async def call(self, op: str, message, reply):
        return await request(self.nc, subjects.registry(op), message, reply, 10)

    async def state(self) -> ReleaseState:
        reply = await self.call("release_status", ReleaseStatusRequest(adapter_id="sea"), ReleaseStatusReply)
        return reply.releases[0]

    async def wait_phase(self, phases: set[str], until: Callable[[ReleaseState], bool] | None = None) -> ReleaseState:
        deadline = self.deadline(DEADLINE_S)
        state: ReleaseState | None = None
        while True:
            with contextlib.suppress(LorafleetError, IndexError):
                state = await self.state()
                if state.phase in phases or (until is not None and until(state)):
                    return state
            assert time.monotonic() < deadline, f"no decision in time; last state: {state!r}\n{self.log_tails()}"
            await asyncio.sleep(0.1)


# no worker runs here: the eval gate (tests/registry/test_registry_bus.py, tests/e2e/test_platform_eval.py)
# is skipped, audited, and the live figures alone decide
START = ReleaseStartRequest(adapter_id="sea", version=2, skip_eval=True, reason="live figures decide", actor="t")


@pytest.fixture
async def live(own_nats, base_dir: Path, adapter_files: dict[str, bytes], tmp_path: Path) -> AsyncIterator[Live]:
    env = {
        "LF_NATS_URL": own_nats.url,
        "LF_MODEL_DIR": str(base_dir),
        "LF_DEV_MODE": "1",
        "LF_MAX_RANK": "16",
        "LF_METRICS_PORT": "-1",
        "LF_HEARTBEAT_INTERVAL_S": "0.2",
        "LF_MODEL_CACHE": os.environ["LF_MODEL_CACHE"],
        **SETTINGS,
    }
    stack = Stack(env, tmp_path / "logs")
    nc = await connect(own_nats.url, "release-live-test")
    found = Live(stack, nc)
    try:
        await found.start_registry("reg-1")
        inline = {name: base64.b64encode(data).decode() for name, data in adapter_files.items()}
        for _ in (1, 2):  # versions 1 and 2
            register = RegisterRequest(
                adapter_id="sea", tenant_id="acme", task_type="t", inline_files=inline, actor="t"
            )
            await found.call("register", register, AdapterRecordsReply)
        await found.call(
            "promote",
            PromoteRequest(adapter_id="sea", version=1, traffic_percent=100, skip_eval=True, reason="seed", actor="t"),
            AdapterRecordsReply,
        )
        yield found
    finally:
        stack.stop_all()
        await nc.close()


@contextlib.asynccontextmanager
async def traffic(live: Live, behaviour: Behaviour) -> AsyncIterator[None]:
    source = Traffic(live.nc, behaviour)
    tasks = [asyncio.create_task(source.follow_catalog()), asyncio.create_task(source.run())]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def statuses(live: Live) -> dict[int, tuple[str, float]]:
    reply = await live.call("get", GetAdapterRequest(adapter_id="sea"), AdapterRecordsReply)
    return {r.version: (r.status, r.traffic_percent) for r in reply.records}


async def test_a_good_version_is_released_step_by_step(live: Live) -> None:
    async with traffic(live, lambda v, i: {}):
        await live.call("release_start", START, ReleaseStatusReply)
        state = await live.wait_phase({"released", "rolled_back", "superseded"})
    assert state.phase == "released", state.decisions
    assert [(d.action, d.percent) for d in state.decisions] == [
        ("started", 1.0),
        ("advanced", 10.0),
        ("advanced", 50.0),
        ("released", 100.0),
    ]
    assert await statuses(live) == {1: ("retired", 0.0), 2: ("production", 100.0)}


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        (lambda v, i: {"outcome": "error"} if v == 2 and i % 2 == 0 else {}, "error rate"),
        (lambda v, i: {"ttft_ms": 400.0 + i % 20} if v == 2 else {}, "TTFT p50 ms"),
        (lambda v, i: {"engine_s": 0.06} if v == 2 else {}, "engine time per output token"),
    ],
    ids=["errors", "latency", "cost"],
)
async def test_a_bad_version_is_rolled_back_without_any_cli(live: Live, behaviour: Behaviour, reason: str) -> None:
    async with traffic(live, behaviour):
        await live.call("release_start", START, ReleaseStatusReply)
        state = await live.wait_phase({"released", "rolled_back", "superseded"})
    assert state.phase == "rolled_back", state.decisions
    last = state.decisions[-1]
    assert last.action == "rolled_back" and last.reasons[0].startswith(reason)
    assert last.canary is not None and last.canary.samples >= 15
    assert await statuses(live) == {1: ("production", 100.0), 2: ("staging", 0.0)}


async def test_a_killed_registry_is_replaced_and_the_rollout_carries_on(live: Live) -> None:
    async with traffic(live, lambda v, i: {}):
        await live.call("release_start", START, ReleaseStatusReply)
        mid = await live.wait_phase({"released", "rolled_back"}, until=lambda s: s.step >= 1)
        assert (mid.phase, mid.owner) == ("running", "reg-1")
        live.stack.kill("reg-1")  # SIGKILL mid-rollout, lease held
        await live.start_registry("reg-2")
        state = await live.wait_phase({"released", "rolled_back", "superseded"})
    assert state.phase == "released" and state.owner == "reg-2", state.decisions
    assert [d.percent for d in state.decisions] == [1.0, 10.0, 50.0, 100.0]
    assert await statuses(live) == {1: ("retired", 0.0), 2: ("production", 100.0)}
