"""The release pipeline end to end: the shipped adapters beat the base model through the gateway,
a broken version cannot pass the release gate, and a canary that breaks the answer format is
rolled back by the registry's release controller on its users' live feedback, and audited."""

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import nats
import openai
import pytest
import torch
from nats.aio.client import Client as NATS
from safetensors.torch import load_file, save_file

from lorafleet.cli.adapter_cmd import push_adapter
from lorafleet.cli.keys_cmd import ensure_trusted
from lorafleet.evaluation.release import evaluate, promote, record_eval
from lorafleet.evaluation.runner import gateway_client, load_eval_set
from services.auditor.store import AuditStore
from services.registry.release_policy import wilson_lower
from shared import signing, subjects
from shared.base_model import EMBEDDED_MODEL_NAME, resolve_model_dir
from shared.bus import request
from shared.catalog.rollout import in_canary, split_key
from shared.errors import Conflict, ReleaseGateFailed
from shared.eval_scorers import answer_format
from shared.fingerprint import fingerprint_model_dir
from shared.schemas import (
    AdapterRecordsReply,
    ApiKeyCreatedReply,
    CreateApiKeyRequest,
    CreateTenantRequest,
    GetAdapterRequest,
    ReleaseStartRequest,
    ReleaseStatusReply,
    ReleaseStatusRequest,
    TenantsReply,
)

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "lorafleet" / "demo_adapters"
ADAPTERS = ("sql-employees", "json-extract", "capital-answer")
MARGIN = 0.3
T = TypeVar("T")


@dataclass(frozen=True)
class Release:
    nats_url: str
    gateway_url: str
    admin_key: str  # inference + admin: may pin a staging version
    sign_key: Path
    fingerprint: str
    db_path: Path

    def run(self, work: Callable[[NATS, openai.AsyncOpenAI], Awaitable[T]]) -> T:
        async def go() -> T:
            nc = await nats.connect(self.nats_url)
            try:
                return await work(nc, gateway_client(self.gateway_url, self.admin_key))
            finally:
                await nc.close()

        return asyncio.run(go())


@pytest.fixture(scope="module")
def release(running_stack, tmp_path_factory) -> Release:
    keys = signing.generate_keypair()
    sign_key = tmp_path_factory.mktemp("keys") / "release.key"
    sign_key.write_bytes(keys.private_pem)

    async def setup() -> str:
        nc = await nats.connect(running_stack.nats.url)
        await ensure_trusted(nc, "release", keys.public_b64, ["demo"], "test")
        with contextlib.suppress(Conflict):
            await request(
                nc,
                subjects.registry("tenant_create"),
                CreateTenantRequest(tenant_id="demo", actor="test"),
                TenantsReply,
                10,
            )
        created = await request(
            nc,
            subjects.registry("api_key_create"),
            CreateApiKeyRequest(tenant_id="demo", scopes=["inference", "admin"], actor="test"),
            ApiKeyCreatedReply,
            10,
        )
        await nc.close()
        return created.key

    fingerprint = fingerprint_model_dir(resolve_model_dir(None))
    found = Release(
        running_stack.nats.url,
        running_stack.gateway_url,
        asyncio.run(setup()),
        sign_key,
        fingerprint,
        running_stack.db_path,
    )

    async def push_all(nc: NATS, _: openai.AsyncOpenAI) -> None:
        for name in ADAPTERS:
            await push_adapter(
                nc,
                EXAMPLES / name / "adapter",
                adapter_id=name,
                tenant_id="demo",
                task_type=name,
                base_fingerprint=fingerprint,
                sign_key=sign_key,
                who="test",
            )

    found.run(push_all)
    return found


async def _records(nc: NATS, adapter_id: str) -> dict[int, str]:
    reply = await request(
        nc, subjects.registry("get"), GetAdapterRequest(adapter_id=adapter_id), AdapterRecordsReply, 10
    )
    return {r.version: r.status for r in reply.records}


def _broken_copy(source: Path, target: Path) -> Path:
    """The same adapter with its weights replaced by noise: well-formed, signed, and useless."""
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    torch.manual_seed(0)
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(
        {k: (torch.randn_like(v.float()) * 0.2).half() for k, v in tensors.items()},
        target / "adapter_model.safetensors",
    )
    return target


def test_each_shipped_adapter_beats_the_base_model_and_is_released(release: Release) -> None:
    async def work(nc: NATS, client: openai.AsyncOpenAI) -> dict[str, tuple[float, float]]:
        scores = {}
        for name in ADAPTERS:
            eval_set = load_eval_set(EXAMPLES / name / "eval.jsonl")
            evaluation = await evaluate(client, name, 1, eval_set, base_model=EMBEDDED_MODEL_NAME, max_tokens=40)
            scores[name] = (evaluation.adapter.score, evaluation.base.score)
            await record_eval(nc, name, 1, evaluation, "test")
            await promote(nc, name, 1, 100, "test")
            assert (await _records(nc, name))[1] == "production"
        return scores

    scores = release.run(work)
    print({name: f"adapter {a:.3f} vs base {b:.3f}" for name, (a, b) in scores.items()})
    for name, (adapter, base) in scores.items():
        assert adapter - base >= MARGIN, f"{name}: adapter {adapter:.3f} vs base {base:.3f}"


def test_a_broken_version_fails_the_release_gate(release: Release, tmp_path: Path) -> None:
    broken = _broken_copy(EXAMPLES / "sql-employees" / "adapter", tmp_path / "broken")
    shipped = (EXAMPLES / "sql-employees" / "eval.jsonl").read_text().splitlines()
    eval_set = tmp_path / "eval.jsonl"
    eval_set.write_text("\n".join(shipped[:5]))  # its meta (threshold) and four items: the gate runs them itself

    async def work(nc: NATS, client: openai.AsyncOpenAI) -> tuple[float, float]:
        if (await _records(nc, "sql-employees"))[1] != "production":  # run alone, without the release test above
            await promote(nc, "sql-employees", 1, 100, "test", skip_eval=True, reason="run alone")
        record = await push_adapter(
            nc,
            broken,
            adapter_id="sql-employees",
            tenant_id="demo",
            task_type="sql",
            base_fingerprint=release.fingerprint,
            sign_key=release.sign_key,
            who="test",
            eval_set=eval_set,
        )
        assert record.version == 2
        evaluation = await evaluate(client, "sql-employees", 2, load_eval_set(eval_set), base_model=None, max_tokens=40)
        await record_eval(nc, "sql-employees", 2, evaluation, "test")  # advisory: the gate runs its own
        with pytest.raises(ReleaseGateFailed, match="under its release threshold"):
            await promote(nc, "sql-employees", 2, 10, "test")
        assert await _records(nc, "sql-employees") == {1: "production", 2: "staging"}
        reply = await request(
            nc,
            subjects.registry("get"),
            GetAdapterRequest(adapter_id="sql-employees", version=2),
            AdapterRecordsReply,
            10,
        )
        run = reply.records[0].platform_eval
        assert run is not None and run.items == 4
        return evaluation.adapter.score, run.score

    client_score, platform_score = release.run(work)
    assert client_score < 0.3 and platform_score < 0.3


def _format_broken_copy(source: Path, target: Path) -> Path:
    """The same adapter with its LoRA B matrices zeroed: well-formed, signable, and answering as the
    base model does, without the ``ANSWER: <city>`` format the adapter was trained for."""
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(
        {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()},
        target / "adapter_model.safetensors",
    )
    return target


async def _traffic(release: Release, questions: list, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """Users asking capitals, half of them in the 1% canary's buckets; each rates the answer's format."""

    def canary(user: str) -> bool:
        return in_canary("capital-answer", split_key("demo", user), 1.0)

    canary_users = (u for u in (f"user-{i}" for i in itertools.count()) if canary(u))
    other_users = (u for u in (f"user-{i}" for i in itertools.count()) if not canary(u))
    headers = {"Authorization": f"Bearer {release.admin_key}"}
    async with httpx.AsyncClient(base_url=release.gateway_url, headers=headers, timeout=120) as http:

        async def one(i: int) -> None:
            item = questions[i % len(questions)]
            user = next(canary_users if i % 2 == 0 else other_users)
            body = {
                "model": "capital-answer",
                "messages": item.messages,
                "max_tokens": 16,
                "temperature": 0,
                "user": user,
            }
            try:
                reply = await http.post("/v1/chat/completions", json=body)
            except httpx.TimeoutException:  # a loaded machine: a user who gave up, not a verdict
                counts["timeouts"] += 1
                return
            if reply.status_code != 200:
                counts["errors"] += 1
                return
            answer = reply.json()["choices"][0]["message"]["content"]
            rating = "up" if answer_format(answer, item.expected) == 1.0 else "down"
            rated = await http.post(
                "/v1/feedback",
                json={"request_id": reply.headers["x-lorafleet-request-id"], "rating": rating, "reason": answer[:200]},
            )
            assert rated.status_code == 200, rated.text
            counts[f"{reply.headers['x-lorafleet-version']}:{rating}"] += 1

        async def user_loop(first: int) -> None:
            for i in itertools.count(first, 4):
                if stop.is_set():
                    return
                await one(i)

        await asyncio.gather(*(user_loop(k) for k in range(4)))


def test_a_canary_that_breaks_the_answer_format_is_rolled_back_on_live_feedback(
    release: Release, tmp_path: Path
) -> None:
    broken = _format_broken_copy(EXAMPLES / "capital-answer" / "adapter", tmp_path / "broken")
    questions = load_eval_set(EXAMPLES / "capital-answer" / "eval.jsonl").items

    async def work(nc: NATS, _: openai.AsyncOpenAI):
        statuses = await _records(nc, "capital-answer")
        if statuses[1] != "production":  # run alone, without the release test above
            await promote(nc, "capital-answer", 1, 100, "test", skip_eval=True, reason="run alone")
        record = await push_adapter(
            nc,
            broken,
            adapter_id="capital-answer",
            tenant_id="demo",
            task_type="capital-answer",
            base_fingerprint=release.fingerprint,
            sign_key=release.sign_key,
            who="test",
        )
        start = ReleaseStartRequest(adapter_id="capital-answer", version=record.version, actor="canary-test")
        with pytest.raises(ReleaseGateFailed, match="has no eval set"):  # the controller's gate is on by default
            await request(nc, subjects.registry("release_start"), start, ReleaseStatusReply, 30)
        forced = start.model_copy(update={"skip_eval": True, "reason": "live traffic decides"})
        await request(nc, subjects.registry("release_start"), forced, ReleaseStatusReply, 30)
        # from here on no process of the test's drives the rollout: only users and their ratings
        stop, counts = asyncio.Event(), collections.Counter()
        users = asyncio.create_task(_traffic(release, questions, stop, counts))
        deadline = time.monotonic() + 600
        try:
            while True:
                state = (
                    await request(
                        nc,
                        subjects.registry("release_status"),
                        ReleaseStatusRequest(adapter_id="capital-answer"),
                        ReleaseStatusReply,
                        30,
                    )
                ).releases[0]
                if state.phase != "running" or users.done() or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
        finally:
            stop.set()
            await users
        return record.version, state, counts, await _records(nc, "capital-answer")

    version, state, counts, statuses = release.run(work)
    print(dict(counts), state.decisions[-1].reasons)
    assert state.phase == "rolled_back", state.decisions
    assert statuses[1] == "production" and statuses[version] == "staging"
    decision = state.decisions[-1]
    assert decision.reasons[0].startswith("complaint rate")
    canary, baseline = decision.canary, decision.baseline
    assert baseline is not None and baseline.complaint_rate < 0.5  # v1 keeps the format
    assert canary is not None and canary.samples >= 6  # LF_RELEASE_GUARD_MIN_SAMPLES: judged from the sixth on
    # every rated canary answer broke the format; a user's rating may still be on its way when the guard trips
    assert canary.feedback >= 1 and canary.complaints == canary.feedback
    # and those complaints alone make the canary worse than production beyond the allowed increase (0.05, the
    # default), at 99% (the registry's one-sided Wilson bound)
    assert wilson_lower(canary.complaints, canary.samples) > baseline.complaint_rate + 0.05
    trail = _audit_trail(release.db_path, "capital-answer", version, until_action="rolled_back")
    rolled_back = [t for t in trail if t[1] == "rolled_back"]
    assert rolled_back and rolled_back[-1][2] == "release-controller" and "complaint rate" in rolled_back[-1][3]


def _audit_trail(db_path: Path, adapter_id: str, version: int, until_action: str) -> list[tuple]:
    """(version, action, actor, reason) of the version's registry changes, once ``until_action`` is indexed."""
    deadline, trail = time.monotonic() + 15, []
    while time.monotonic() < deadline and until_action not in {t[1] for t in trail}:
        time.sleep(0.3)
        store = AuditStore(db_path)
        try:
            rows = [r.body for r in reversed(store.query(kind="registry_change", adapter_id=adapter_id, limit=1000))]
        finally:
            store.close()
        trail = [
            (b["version"], b["action"], b["actor"], b.get("reason") or "") for b in rows if b["version"] == version
        ]
    return trail
