"""Shadow evaluation on the real stack: while a canary is rolled out, every greedy request production
serves is answered by the canary too (LF_SHADOW_SAMPLE=1 here), off the client's path. A canary that
is production's weights pushed again agrees with it and is not rolled back on agreement; a canary of
random weights disagrees and the release controller rolls it back on its shadow agreement. The
agreement and quality regression families are scraped from the registry, the shadow runs from the
scheduler."""

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS

from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.keys_cmd import ensure_trusted
from lorafleet.evaluation.release import promote
from lorafleet.evaluation.runner import load_eval_set
from shared import signing, subjects
from shared.base_model import resolve_model_dir
from shared.bus import decode, request
from shared.catalog.rollout import in_canary, split_key
from shared.errors import Conflict
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import (
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    ReleaseStartRequest,
    ReleaseState,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    RollbackRequest,
    ServiceHeartbeat,
    TenantsReply,
)
from tests.e2e.conftest import RunningStack, stack_of
from tests.e2e.test_release import _broken_copy

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "lorafleet" / "demo_adapters"
ADAPTER = "capital-answer"
MIN_PAIRS = 8
MIN_AGREEMENT = 0.8
DEADLINE_S = 600.0  # a bound for a loaded machine: every wait below returns on its event, far sooner
SERVICE_ENV = {
    "scheduler": {"LF_SHADOW_SAMPLE": "1", "LF_SHADOW_MAX_TOKENS": "16"},
    "registry": {"LF_RELEASE_MIN_SHADOW_PAIRS": str(MIN_PAIRS), "LF_RELEASE_MIN_AGREEMENT": str(MIN_AGREEMENT)},
}


@dataclass(frozen=True)
class Shadowed:
    stack: RunningStack
    key: str  # inference + admin
    sign_key: Path
    fingerprint: str


@pytest.fixture(scope="module")
def shadowed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shadowed]:
    keys = signing.generate_keypair()
    sign_key = tmp_path_factory.mktemp("keys") / "shadow.key"
    sign_key.write_bytes(keys.private_pem)
    fingerprint = fingerprint_model_dir(resolve_model_dir(None))
    with stack_of(tmp_path_factory.mktemp("shadow-stack"), SERVICE_ENV) as stack:

        async def setup() -> str:
            nc = await nats.connect(stack.nats.url)
            try:
                await ensure_trusted(nc, "shadow", keys.public_b64, ["demo"], "test")
                with contextlib.suppress(Conflict):
                    create = CreateTenantRequest(tenant_id="demo", actor="test")
                    await request(nc, subjects.registry("tenant_create"), create, TenantsReply, 10)
                key = CreateApiKeyRequest(tenant_id="demo", scopes=["inference", "admin"], actor="test")
                created = await request(nc, subjects.registry("api_key_create"), key, ApiKeyCreatedReply, 10)
                await push(nc, EXAMPLES / ADAPTER / "adapter", fingerprint, sign_key)
                await promote(nc, ADAPTER, 1, 100, "test", skip_eval=True, reason="the shadow test's production")
                return created.key
            finally:
                await nc.close()

        yield Shadowed(stack, asyncio.run(setup()), sign_key, fingerprint)


async def push(nc: NATS, directory: Path, fingerprint: str, sign_key: Path) -> int:
    record = await push_adapter(
        nc,
        directory,
        adapter_id=ADAPTER,
        tenant_id="demo",
        task_type=ADAPTER,
        base_fingerprint=fingerprint,
        sign_key=sign_key,
        who="test",
    )
    return record.version


async def status(nc: NATS) -> ReleaseState:
    reply = await request(
        nc, subjects.registry("release_status"), ReleaseStatusRequest(adapter_id=ADAPTER), ReleaseStatusReply, 30
    )
    return reply.releases[0]


async def production_traffic(shadowed: Shadowed, stop: asyncio.Event, served: list[str]) -> None:
    """Greedy users all in production's buckets: the canary serves none of them, and answers each in the shadow."""
    questions = load_eval_set(EXAMPLES / ADAPTER / "eval.jsonl").items
    users = (u for u in (f"user-{i}" for i in itertools.count()) if not in_canary(ADAPTER, split_key("demo", u), 1.0))
    headers = {"Authorization": f"Bearer {shadowed.key}"}
    async with httpx.AsyncClient(base_url=shadowed.stack.gateway_url, headers=headers, timeout=120) as http:

        async def user_loop(first: int) -> None:
            for i in itertools.count(first, 2):
                if stop.is_set():
                    return
                item = questions[i % len(questions)]
                body = {
                    "model": ADAPTER,
                    "messages": item.messages,
                    "max_tokens": 16,
                    "temperature": 0,
                    "user": next(users),
                }
                with contextlib.suppress(httpx.TimeoutException):  # a loaded machine: a user who gave up
                    reply = await http.post("/v1/chat/completions", json=body)
                    if reply.status_code == 200:
                        served.append(reply.headers["x-lorafleet-version"])

        await asyncio.gather(user_loop(0), user_loop(1))


async def rollout_until(
    shadowed: Shadowed, nc: NATS, version: int, done: Callable[[ReleaseState], bool]
) -> tuple[ReleaseState, list[str]]:
    """Start ``version``'s rollout (its eval skipped: the shadow decides), drive production traffic
    until the controller's state satisfies ``done``, and return that state and the versions served."""
    start = ReleaseStartRequest(
        adapter_id=ADAPTER, version=version, skip_eval=True, reason="the shadow decides", actor="shadow-test"
    )
    await request(nc, subjects.registry("release_start"), start, ReleaseStatusReply, 60)
    stop, served = asyncio.Event(), []
    users = asyncio.create_task(production_traffic(shadowed, stop, served))
    deadline = time.monotonic() + DEADLINE_S
    try:
        while True:
            state = await status(nc)
            if done(state) or users.done():
                return state, served
            assert time.monotonic() < deadline, state.decisions
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await users


def canary_figures(state: ReleaseState):
    return next((f for f in state.figures if f.version == state.version), None)


async def metrics_text(nats_url: str, service: str) -> str:
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(subjects.service_heartbeat(service))
        while True:
            beat = decode(ServiceHeartbeat, (await sub.next_msg(timeout=30)).data)
            if beat.metrics_port:
                break
    finally:
        await nc.close()
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{beat.metrics_port}/metrics")).text


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_canary_identical_to_production_agrees_and_is_not_rolled_back(shadowed: Shadowed) -> None:
    async def work() -> tuple[int, ReleaseState, list[str], str]:
        nc = await nats.connect(shadowed.stack.nats.url)
        try:
            version = await push(nc, EXAMPLES / ADAPTER / "adapter", shadowed.fingerprint, shadowed.sign_key)

            def paired(state: ReleaseState) -> bool:
                canary = canary_figures(state)
                return state.phase != "running" or (canary is not None and canary.shadow_pairs >= MIN_PAIRS)

            state, served = await rollout_until(shadowed, nc, version, paired)
            scraped = await metrics_text(shadowed.stack.nats.url, "registry")
            # end it, so that the next test rolls out its own canary: the controller sees the operator's rollback
            rollback = RollbackRequest(adapter_id=ADAPTER, reason="the shadow test is done", actor="test")
            await request(nc, subjects.registry("rollback"), rollback, AdapterRecordsReply, 30)
            deadline = time.monotonic() + DEADLINE_S
            while (await status(nc)).phase == "running":
                assert time.monotonic() < deadline, "the controller did not see the operator's rollback"
                await asyncio.sleep(0.2)
            return version, state, served, scraped
        finally:
            await nc.close()

    version, state, served, scraped = asyncio.run(work())
    assert state.phase == "running", state.decisions
    canary = canary_figures(state)
    print("identical canary:", canary)
    assert canary is not None and canary.shadow_pairs >= MIN_PAIRS
    assert canary.agreement_rate is not None and canary.agreement_rate >= MIN_AGREEMENT, canary
    assert canary.samples == 0 and set(served) == {"1"}  # every answer the users got was production's
    labels = {"adapter": ADAPTER, "canary_version": str(version), "production_version": "1"}
    agreement = sample(scraped, "shadow_agreement_ratio", **labels, measure="exact")
    assert agreement is not None and agreement >= MIN_AGREEMENT
    assert sample(scraped, "quality_regression", **labels, measure="exact") == pytest.approx(agreement - 1)
    assert (sample(scraped, "shadow_pairs_total", **labels, agree="true") or 0) >= MIN_PAIRS * MIN_AGREEMENT


def test_a_canary_whose_shadow_answers_differ_is_rolled_back_on_agreement(shadowed: Shadowed, tmp_path: Path) -> None:
    broken = _broken_copy(EXAMPLES / ADAPTER / "adapter", tmp_path / "random")

    async def work() -> tuple[int, ReleaseState, list[str], str, str]:
        nc = await nats.connect(shadowed.stack.nats.url)
        try:
            version = await push(nc, broken, shadowed.fingerprint, shadowed.sign_key)
            state, served = await rollout_until(shadowed, nc, version, lambda s: s.phase != "running")
            registry = await metrics_text(shadowed.stack.nats.url, "registry")
            scheduler = await metrics_text(shadowed.stack.nats.url, "scheduler")
            return version, state, served, registry, scheduler
        finally:
            await nc.close()

    version, state, served, registry, scheduler = asyncio.run(work())
    assert state.phase == "rolled_back", state.decisions
    decision = state.decisions[-1]
    print("random canary:", decision.reasons, decision.canary)
    assert decision.reasons[0].startswith("shadow agreement"), decision.reasons
    assert decision.canary is not None and decision.canary.shadow_pairs >= MIN_PAIRS
    assert decision.canary.agreement_rate is not None and decision.canary.agreement_rate < MIN_AGREEMENT
    assert set(served) == {"1"}
    labels = {"adapter": ADAPTER, "canary_version": str(version), "production_version": "1"}
    regression = sample(registry, "quality_regression", **labels, measure="exact")
    assert regression is not None and regression < MIN_AGREEMENT - 1
    assert (sample(registry, "shadow_pairs_total", **labels, agree="false") or 0) >= 1
    assert (sample(scheduler, "shadow_runs_total", fate="dispatched") or 0) >= 2 * MIN_PAIRS
