"""Tenant isolation through the worker's serving path on the real engine (issue 47): prompt K/V is
shared within a tenant only, and only the adapter's owner is told whether it was resident."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.worker.adapter_cache import CacheConfig, CacheHierarchy
from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import AdapterManager, AdapterWeights, LoraConfig, ModelShapes
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from shared.catalog.access import SHARED_TENANT
from shared.request_ref import RequestRef
from shared.schemas import InferRequest, ReplyAccepted, ReplyFinal, ResolvedAdapter, SamplingParams
from tests.helpers.adapters import make_peft_model

DIGEST = "0" * 64
BLOCK = 16
# four full KV blocks and more: a prefix hit, when there is one, is at least BLOCK * 4 tokens
PROMPT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(8))
OWNERS = {"mine": "acme", "common": SHARED_TENANT}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def adapter_dir(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("iso") / "iso"
    make_peft_model(loaded.model, rank=8, alpha=16, seed=5).save_pretrained(directory)
    return directory


@dataclass
class Worker:
    server: RequestServer
    engine: AsyncEngine
    events: list[tuple[str, object]] = field(default_factory=list)

    async def serve(self, tenant: str, rid: str, adapter_id: str | None) -> tuple[ReplyAccepted, ReplyFinal, int]:
        """Run one request to its end: its accept notice, its final reply and the prompt tokens the
        prefix cache gave it."""
        before = self.engine.engine.blocks.hit_tokens
        resolved = (
            ResolvedAdapter(adapter_id=adapter_id, version=1, rank=8, digest=DIGEST, storage_uri="test://iso", alpha=16)
            if adapter_id
            else None
        )
        inbox = f"_INBOX.{tenant}.{rid}"
        request = InferRequest(
            request_id=rid,
            tenant_id=tenant,
            model="m",
            base_model=self.server.base_model,
            adapter=resolved,
            prompt=PROMPT,
            reply_to=inbox,
            sampling=SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
        )
        await self.server.accept(request)
        deadline = time.monotonic() + 120
        while not any(i == inbox and isinstance(m, ReplyFinal) for i, m in self.events):
            assert time.monotonic() < deadline, f"no final reply for {rid}"
            await asyncio.sleep(0.01)
        mine = [m for i, m in self.events if i == inbox]
        accepted = next(m for m in mine if isinstance(m, ReplyAccepted))
        final = next(m for m in mine if isinstance(m, ReplyFinal))
        return accepted, final, self.engine.engine.blocks.hit_tokens - before


@pytest.fixture
async def worker(loaded: LoadedModel, adapter_dir: Path) -> AsyncIterator[Worker]:
    manager = AdapterManager(
        LoraConfig(
            rank_classes=(8,), memory_budget_bytes=2**24, max_slots_per_class=2, target_modules=("q_proj", "v_proj")
        ),
        ModelShapes.from_hf_config(loaded.model.config),
    )

    def store(key: str) -> AdapterWeights:
        return manager.read_adapter(adapter_dir)

    cache = CacheHierarchy(manager, store, CacheConfig())
    engine = AsyncEngine.from_loaded(
        loaded,
        EngineConfig(kv_cache_bytes=32 * 2**20, kv_block_size=BLOCK, max_model_len=256, max_num_batched_tokens=256),
        adapter_manager=manager,
    )
    engine.start()
    events: list[tuple[str, object]] = []

    async def emit(reply_to: str, message: object) -> None:
        events.append((reply_to, message))

    async def audit(_: object) -> None:
        return None

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(
        engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16, cache=cache, owner_of=OWNERS.get
    )
    try:
        yield Worker(server, engine, events)
    finally:
        cache.close()
        engine.shutdown()


@pytest.mark.parametrize("adapter_id", ["common", None], ids=["shared-adapter", "base-model"])
async def test_prompt_kv_is_shared_within_a_tenant_only(worker: Worker, adapter_id: str | None) -> None:
    """Same prompt, same base and adapter: the second tenant computes its prompt afresh, while the
    first tenant's next request reads its own blocks."""
    assert len(worker.server.prompts.encode(None, PROMPT, None)) > 4 * BLOCK
    *_, first = await worker.serve("acme", "a1", adapter_id)
    *_, other = await worker.serve("globex", "g1", adapter_id)
    *_, again = await worker.serve("acme", "a2", adapter_id)
    *_, other_again = await worker.serve("globex", "g2", adapter_id)
    assert (first, other) == (0, 0)
    assert again >= 4 * BLOCK and other_again == again


async def test_only_the_adapters_owner_is_told_whether_it_was_resident(worker: Worker) -> None:
    accepted, final, _ = await worker.serve("acme", "own-1", "mine")
    assert (accepted.cache_hit, final.served_by.cache_hit) == (False, False)
    accepted, final, _ = await worker.serve("acme", "own-2", "mine")
    assert (accepted.cache_hit, final.served_by.cache_hit) == (True, True)

    # acme's traffic loads the shared adapter; globex, next, must not learn that it is resident
    for tenant in ("acme", "globex", "globex"):
        accepted, final, _ = await worker.serve(tenant, f"common-{tenant}-{len(worker.events)}", "common")
        assert (accepted.cache_hit, final.served_by.cache_hit) == (None, None)
    assert worker.server.cache is not None and "common@1" in worker.server.cache.stats().gpu_adapters

    accepted, final, _ = await worker.serve("globex", "base", None)
    assert (accepted.cache_hit, final.served_by.cache_hit) == (True, True)  # the base model is always resident


async def test_the_engine_counts_each_request_toward_its_tenants_kv_share(worker: Worker) -> None:
    """The serving path names the tenant to the engine, whose scheduler holds it to tenant_kv_share."""
    request = InferRequest(
        request_id="long",
        tenant_id="globex",
        model="m",
        base_model=worker.server.base_model,
        prompt="Once upon a time",
        reply_to="_INBOX.long",
        sampling=SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    )
    await worker.server.accept(request)
    scheduler = worker.engine.engine.scheduler
    deadline = time.monotonic() + 60
    while not (running := list(scheduler.running)):
        assert time.monotonic() < deadline, "the request never ran"
        await asyncio.sleep(0.01)
    assert [s.request.tenant for s in running] == ["globex"]
    assert worker.server.cancel(RequestRef("globex", "long"))
    while worker.server.tasks:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
