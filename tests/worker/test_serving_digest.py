"""The digest an adapter's weights were verified against travels with them into the worker's slot:
the served digest reaches the completion record, and a grant naming other weights is refused."""

import asyncio
import hashlib
import time

from services.worker.adapter_cache import CacheConfig, CacheHierarchy
from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from shared.adapter_format import WEIGHTS_FILE
from shared.schemas import CompletionAudit, InferRequest, RejectionAudit, ReplyError, ReplyFinal, ResolvedAdapter
from tests.worker.test_serving_cache import (  # the fixtures too: one model and adapter per module, as there
    DIGEST,
    GatedStore,
    cold_adapter,  # noqa: F401
    loaded,  # noqa: F401
    request,
)


async def test_the_slots_digest_reaches_the_record_and_other_weights_than_granted_are_refused(loaded, cold_adapter):  # noqa: F811
    """The digest the weights were verified against travels with them into the slot: a request granted
    that digest is served and its completion record names it; one granted another digest (the catalog
    moved on, or the store changed under a key) is refused as an integrity error, on a hit as on a miss."""
    manager = AdapterManager(
        LoraConfig(
            rank_classes=(8,), memory_budget_bytes=2**24, max_slots_per_class=2, target_modules=("q_proj", "v_proj")
        ),
        ModelShapes.from_hf_config(loaded.model.config),
    )
    digest = hashlib.sha256((cold_adapter / WEIGHTS_FILE).read_bytes()).hexdigest()
    store = GatedStore(manager, cold_adapter, digest)
    store.gate.set()
    cache = CacheHierarchy(manager, store, CacheConfig())
    engine = AsyncEngine.from_loaded(
        loaded,
        EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256),
        adapter_manager=manager,
    )
    engine.start()
    replies: dict[str, list[object]] = {}
    audits: list[object] = []

    async def emit(reply_to: str, message) -> None:
        replies.setdefault(reply_to, []).append(message)

    async def audit(record) -> None:
        audits.append(record)

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16, cache=cache)

    def granted(rid: str, weights: str) -> InferRequest:
        adapter = ResolvedAdapter(
            adapter_id="cold", version=1, rank=8, digest=weights, storage_uri="test://c", alpha=16
        )
        return request(loaded, rid, adapter=True).model_copy(update={"adapter": adapter})

    async def served(rid: str, weights: str) -> object:
        await server.accept(granted(rid, weights))
        deadline = time.monotonic() + 60
        while not any(isinstance(m, ReplyFinal | ReplyError) for m in replies.get(f"_INBOX.{rid}", [])):
            assert time.monotonic() < deadline, f"{rid} never finished"
            await asyncio.sleep(0.01)
        return replies[f"_INBOX.{rid}"][-1]

    try:
        refused = await served("other-miss", DIGEST)
        assert isinstance(refused, ReplyError) and refused.error.code == "integrity_error"
        assert isinstance(await served("exact", digest), ReplyFinal)  # a hit now: the slot holds the weights
        refused = await served("other-hit", DIGEST)
        assert isinstance(refused, ReplyError) and refused.error.code == "integrity_error"
        while server.tasks:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        completions = [a for a in audits if isinstance(a, CompletionAudit)]
        assert {(a.request_id, a.adapter_digest) for a in completions if a.outcome == "length"} == {("exact", digest)}
        rejections = [a for a in audits if isinstance(a, RejectionAudit)]
        assert sorted(a.request_id for a in rejections) == ["other-hit", "other-miss"]
        assert all(a.code == "integrity_error" and digest[:12] in a.reason for a in rejections)
    finally:
        cache.close()
        engine.shutdown()
