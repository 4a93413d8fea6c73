"""SLO classes on the worker's serving path: the class reaches the engine's admission, TTFT and TPOT
histograms by class, met or missed against the scheduler's TTFT target, the attainment window, the audit."""

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from services.worker.slo_attainment import SloAttainment, ttft_outcome
from shared.schemas import CompletionAudit, InferRequest, ReplyMessage, ReplyToken, SamplingParams, SloClass


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("first_token_after_s", "target_s", "failed", "expected"),
    [
        (0.5, None, False, None),  # no target: neither met nor missed
        (0.5, 1.0, False, "met"),
        (1.5, 1.0, False, "missed"),
        (None, 1.0, True, "missed"),  # failed before its first token
        (None, 60.0, False, None),  # cancelled by its client, its target not yet passed
        (None, 0.5, False, "missed"),  # cancelled after its target passed without a token
    ],
)
def test_ttft_outcome(first_token_after_s: float | None, target_s: float | None, failed: bool, expected: str | None):
    created = time.time() - 1.0
    first = None if first_token_after_s is None else created + first_token_after_s
    assert ttft_outcome(created, first, target_s, failed) == expected


def test_the_attainment_ratio_covers_the_last_window_requests_of_a_class():
    slo = SloAttainment(window=3)
    ratios = [slo.record("batch", outcome) for outcome in ("missed", "met", "met", "met")]
    assert ratios == [0.0, 0.5, pytest.approx(2 / 3), 1.0]  # the first miss has left the window
    assert sample("slo_attainment_ratio", slo_class="batch") == 1.0
    slo.record("interactive", "missed")
    assert sample("slo_attainment_ratio", slo_class="batch") == 1.0  # each class has its own window


def request(loaded: LoadedModel, rid: str, slo: SloClass | None, target_s: float | None, tokens: int) -> InferRequest:
    return InferRequest(
        request_id=rid,
        tenant_id="acme",
        model="m",
        base_model=loaded.name,
        prompt="Once upon a time",
        reply_to=f"_INBOX.{rid}",
        sampling=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
        priority=slo,
        ttft_target_s=target_s,
    )


async def test_classes_reach_the_engine_and_every_request_is_measured_by_its_class(loaded: LoadedModel):
    """One sequence slot and no preemption for waiting requests: with a batch request running, a
    standard then an interactive one queue; the interactive one gets its first token first."""
    config = EngineConfig(
        kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=1,
        class_preempt_after_steps=None,
    )  # fmt: skip
    engine = AsyncEngine.from_loaded(loaded, config)
    engine.start()
    firsts: list[str] = []
    audits: list[CompletionAudit] = []

    async def emit(reply_to: str, message: ReplyMessage) -> None:
        if isinstance(message, ReplyToken) and reply_to not in firsts:
            firsts.append(reply_to)

    async def audit(record) -> None:
        audits.append(record)

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16)
    families = [("slo_ttft_ms_count", c) for c in ("batch", "standard", "interactive")]
    families += [("slo_tpot_ms_count", c) for c in ("batch", "standard", "interactive")]
    outcomes = [(c, o) for c in ("batch", "standard", "interactive") for o in ("met", "missed")]
    before = {f: sample(f[0], slo_class=f[1]) for f in families}
    counted = {f: sample("slo_requests_total", slo_class=f[0], outcome=f[1]) for f in outcomes}
    try:
        await server.accept(request(loaded, "batch", "batch", 1e-3, tokens=200))  # a target it cannot meet
        # (200 tokens: still running when the next two are accepted, however fast this machine decodes)
        deadline = time.monotonic() + 120
        while not firsts:
            assert time.monotonic() < deadline, "no token"
            await asyncio.sleep(0.01)
        await server.accept(request(loaded, "standard", None, None, tokens=4))  # bypassed the scheduler
        await server.accept(request(loaded, "interactive", "interactive", 600.0, tokens=4))
        while server.tasks:
            assert time.monotonic() < deadline, "a request never ended"
            await asyncio.sleep(0.01)
    finally:
        engine.shutdown()
    assert firsts == ["_INBOX.batch", "_INBOX.interactive", "_INBOX.standard"]
    assert {f: sample(f[0], slo_class=f[1]) - before[f] for f in families} == dict.fromkeys(families, 1.0)
    grew = {f: sample("slo_requests_total", slo_class=f[0], outcome=f[1]) - counted[f] for f in outcomes}
    assert {f: n for f, n in grew.items() if n} == {("batch", "missed"): 1.0, ("interactive", "met"): 1.0}
    assert sample("slo_attainment_ratio", slo_class="interactive") == 1.0
    assert {a.request_id: a.slo_class for a in audits} == {
        "batch": "batch",
        "standard": "standard",
        "interactive": "interactive",
    }
