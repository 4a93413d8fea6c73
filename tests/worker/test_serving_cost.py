"""Engine time per request on the worker's serving path: the finished request's audit record
carries the engine seconds charged to it, and the per-adapter counters add them up."""

import asyncio

import pytest
from prometheus_client import REGISTRY

from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from shared.schemas import CompletionAudit, InferRequest, ReplyMessage, SamplingParams


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"adapter": "base"}) or 0.0


async def test_a_finished_request_carries_the_engine_time_it_consumed(loaded: LoadedModel) -> None:
    config = EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256)
    engine = AsyncEngine.from_loaded(loaded, config)
    engine.start()
    audits: list[CompletionAudit] = []
    done = asyncio.Event()

    async def emit(reply_to: str, message: ReplyMessage) -> None:
        pass

    async def audit(record) -> None:
        audits.append(record)
        done.set()

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16)
    seconds, tokens = sample("adapter_engine_seconds_total"), sample("adapter_engine_output_tokens_total")
    request = InferRequest(
        request_id="r1",
        tenant_id="acme",
        model="m",
        base_model=loaded.name,
        prompt="Once upon a time",
        reply_to="_INBOX.r1",
        sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )
    try:
        await server.accept(request)
        await asyncio.wait_for(done.wait(), timeout=120)
    finally:
        engine.shutdown()
    (record,) = audits
    assert record.outcome == "length" and record.completion_tokens == 6
    assert record.engine_s is not None and record.engine_s > 0
    assert record.engine_s * 1000 <= record.ttft_ms + record.tpot_ms * 5 + 1  # within its wall time
    assert sample("adapter_engine_seconds_total") - seconds == pytest.approx(record.engine_s)
    assert sample("adapter_engine_output_tokens_total") - tokens == 6
