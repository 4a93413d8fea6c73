"""A run compared in the shadow: the worker's audit record carries digests of its first
``compare_tokens`` output tokens (never their text) and, for the canary's run, the production
request it shadows; a run not compared carries none."""

import asyncio

import pytest

from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from shared.answer_digest import digest_answer
from shared.schemas import CompletionAudit, InferRequest, ReplyMessage, ReplyToken, SamplingParams


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


async def test_compared_runs_carry_their_answers_digest_and_the_shadow_its_production_request(
    loaded: LoadedModel,
) -> None:
    config = EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256)
    engine = AsyncEngine.from_loaded(loaded, config)
    engine.start()
    audits: dict[str, CompletionAudit] = {}
    tokens: dict[str, list[int]] = {}
    done = asyncio.Event()

    async def emit(reply_to: str, message: ReplyMessage) -> None:
        if isinstance(message, ReplyToken):
            tokens.setdefault(message.request_id, []).extend(message.token_ids)

    async def audit(record) -> None:
        audits[record.request_id] = record
        if len(audits) == 3:
            done.set()

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16)

    def request(rid: str, **over) -> InferRequest:
        return InferRequest(
            request_id=rid,
            tenant_id="acme",
            model="m",
            base_model=loaded.name,
            prompt="Once upon a time",
            reply_to=f"_INBOX.{rid}",
            sampling=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
            **over,
        )

    try:
        await server.accept(request("prod", compare_tokens=4))
        await server.accept(request("shadow.x", compare_tokens=4, shadow_of="prod"))
        await server.accept(request("plain"))
        await asyncio.wait_for(done.wait(), timeout=120)
    finally:
        engine.shutdown()
    production, shadow, plain = audits["prod"], audits["shadow.x"], audits["plain"]
    assert production.completion_tokens == 6 and len(tokens["prod"]) == 6
    assert production.answer == digest_answer(tokens["prod"][:4])  # the first compare_tokens only
    assert production.shadow_of is None and shadow.shadow_of == "prod"
    assert shadow.answer == production.answer  # one weights, one greedy answer
    assert plain.answer is None and plain.shadow_of is None
