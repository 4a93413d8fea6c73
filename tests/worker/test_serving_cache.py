"""The worker's serving path with the cache hierarchy on the real engine: a cold adapter loads beside
the running batch, whose tokens keep flowing (asserted by ordering, not timing)."""

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from services.worker.adapter_cache import CacheConfig, CacheHierarchy
from services.worker.engine import AsyncEngine, EngineConfig
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import AdapterManager, AdapterWeights, LoraConfig, ModelShapes
from services.worker.prompt_ids import PromptIds
from services.worker.serving import RequestServer
from shared.errors import ServiceUnavailable
from shared.request_ref import RequestRef
from shared.schemas import (
    CompletionAudit,
    InferRequest,
    ReplyAccepted,
    ReplyFinal,
    ReplyToken,
    ResolvedAdapter,
    SamplingParams,
)
from tests.helpers.adapters import make_peft_model

DIGEST = "0" * 64
BASE_TOKENS = 120  # a base request runs on for many steps after a test acts on its first tokens


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def cold_adapter(loaded: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cold") / "cold"
    make_peft_model(loaded.model, rank=8, alpha=16, seed=3).save_pretrained(directory)
    return directory


class GatedStore:
    """A real adapter read from disk, held at a gate so the test controls when the load finishes."""

    def __init__(self, manager: AdapterManager, directory: Path, digest: str | None = None):
        self.manager, self.directory, self.digest = manager, directory, digest
        self.gate, self.entered = threading.Event(), threading.Event()

    def __call__(self, key: str) -> AdapterWeights:
        self.entered.set()
        assert self.gate.wait(60)
        return dataclasses.replace(self.manager.read_adapter(self.directory), digest=self.digest)


def request(loaded: LoadedModel, rid: str, adapter: bool = False) -> InferRequest:
    resolved = (
        ResolvedAdapter(adapter_id="cold", version=1, rank=8, digest=DIGEST, storage_uri="test://cold", alpha=16)
        if adapter
        else None
    )
    return InferRequest(
        request_id=rid,
        tenant_id="acme",
        model="m",
        base_model=loaded.name,
        adapter=resolved,
        prompt="Once upon a time",
        reply_to=f"_INBOX.{rid}",
        sampling=SamplingParams(max_tokens=BASE_TOKENS if not adapter else 6, temperature=0, ignore_eos=True),
    )


async def test_a_cold_adapter_loads_while_the_running_batch_keeps_streaming(loaded, cold_adapter):
    manager = AdapterManager(
        LoraConfig(
            rank_classes=(8,), memory_budget_bytes=2**24, max_slots_per_class=2, target_modules=("q_proj", "v_proj")
        ),
        ModelShapes.from_hf_config(loaded.model.config),
    )
    store = GatedStore(manager, cold_adapter)
    cache = CacheHierarchy(manager, store, CacheConfig())
    engine = AsyncEngine.from_loaded(
        loaded,
        EngineConfig(kv_cache_bytes=64 * 2**20, max_model_len=256, max_num_batched_tokens=256),
        adapter_manager=manager,
    )
    engine.start()
    events: list[tuple[str, object]] = []  # (reply inbox, message) in arrival order

    async def emit(reply_to: str, message) -> None:
        events.append((reply_to, message))

    async def audit(_) -> None:
        return None

    server = RequestServer(
        engine,
        PromptIds.for_model(loaded.tokenizer, loaded.directory),
        "w1",
        loaded.name,
        emit,
        audit,
        max_waiting=16,
        cache=cache,
    )

    def tokens(rid: str) -> int:
        return sum(1 for inbox, m in events if inbox == f"_INBOX.{rid}" and isinstance(m, ReplyToken))

    async def until(condition, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    try:
        for rid in ("base-a", "base-b"):
            await server.accept(request(loaded, rid))
        await until(lambda: tokens("base-a") >= 3 and tokens("base-b") >= 3)
        await server.accept(request(loaded, "cold", adapter=True))
        accepted = next(m for inbox, m in events if inbox == "_INBOX.cold" and isinstance(m, ReplyAccepted))
        assert accepted.cache_hit is False
        assert await asyncio.to_thread(store.entered.wait, 30)
        before = tokens("base-a"), tokens("base-b")
        await until(lambda: tokens("base-a") >= before[0] + 8 and tokens("base-b") >= before[1] + 8)
        assert tokens("cold") == 0  # the batch ran 8+ steps while the adapter was still loading
        store.gate.set()
        await until(lambda: any(inbox == "_INBOX.cold" and isinstance(m, ReplyFinal) for inbox, m in events))
        await until(lambda: not server.tasks)
        finals = {inbox: m for inbox, m in events if isinstance(m, ReplyFinal)}
        assert finals["_INBOX.cold"].usage.completion_tokens == 6
        assert finals["_INBOX.cold"].served_by.cache_hit is False
        assert finals["_INBOX.base-a"].usage.completion_tokens == BASE_TOKENS
        for inbox in ("_INBOX.base-a", "_INBOX.base-b", "_INBOX.cold"):  # each stream opens with its accept notice
            assert isinstance(next(m for i, m in events if i == inbox), ReplyAccepted)
        order = [inbox for inbox, m in events if isinstance(m, ReplyToken)]
        first_cold = order.index("_INBOX.cold")
        assert order[:first_cold].count("_INBOX.base-a") >= before[0] + 8
        assert cache.stats().gpu_adapters == ["cold@1"]
    finally:
        store.gate.set()
        cache.close()
        engine.shutdown()


async def test_a_request_cancelled_while_running_is_refused_if_dispatched_again(loaded):
    engine = AsyncEngine.from_loaded(
        loaded, EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256)
    )
    engine.start()
    events: list[tuple[str, object]] = []

    async def emit(reply_to: str, message) -> None:
        events.append((reply_to, message))

    async def audit(_) -> None:
        return None

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16)
    try:
        await server.accept(request(loaded, "r"))
        deadline = time.monotonic() + 60
        while not any(isinstance(m, ReplyToken) for _, m in events):  # events is a plain list
            assert time.monotonic() < deadline, "no token"
            await asyncio.sleep(0.01)
        assert server.cancel(RequestRef("acme", "r"))
        with pytest.raises(ServiceUnavailable, match="withdrawn"):
            await server.accept(request(loaded, "r"))  # before: acked as a duplicate, and never run
        while server.tasks:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    finally:
        engine.shutdown()


def _server(loaded, engine: AsyncEngine, finals: list[str], **options) -> RequestServer:
    """A request server on ``engine`` that records the inbox of every final reply in ``finals``."""

    async def emit(reply_to: str, message) -> None:
        if isinstance(message, ReplyFinal):
            finals.append(reply_to)

    async def audit(_) -> None:
        return None

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    return RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16, **options)


async def test_another_tenants_finished_request_under_the_same_id_is_no_duplicate(loaded):
    engine = AsyncEngine.from_loaded(
        loaded, EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256)
    )
    engine.start()
    finals: list[str] = []
    server = _server(loaded, engine, finals)

    async def served(tenant: str) -> None:
        first = request(loaded, "same-id").model_copy(
            update={"tenant_id": tenant, "reply_to": f"_INBOX_{tenant}.r", "sampling": SamplingParams(max_tokens=2)}
        )
        await server.accept(first)
        deadline = time.monotonic() + 60
        while f"_INBOX_{tenant}.r" not in finals:
            assert time.monotonic() < deadline, f"{tenant}'s request never finished"
            await asyncio.sleep(0.01)

    try:
        await served("attacker")
        await served("victim")  # before: acked as a duplicate of the attacker's, and never run
        while server.tasks:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await server.accept(request(loaded, "same-id").model_copy(update={"tenant_id": "victim"}))
        assert not server.tasks  # the victim's redispatch is a duplicate: it runs once
        assert finals == ["_INBOX_attacker.r", "_INBOX_victim.r"]
    finally:
        engine.shutdown()


async def test_two_tenants_run_one_request_id_at_once_and_a_cancel_stops_only_its_own(loaded):
    """Before: the second tenant's dispatch was refused (request_id_in_use) while the first ran, and
    the engine knew both by the bare id."""
    engine = AsyncEngine.from_loaded(
        loaded, EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256)
    )
    engine.start()
    events: list[tuple[str, object]] = []
    audits: list[CompletionAudit] = []

    async def emit(reply_to: str, message) -> None:
        events.append((reply_to, message))

    async def audit(record) -> None:
        audits.append(record)

    def of(tenant: str) -> InferRequest:
        return request(loaded, "same-id").model_copy(
            update={
                "tenant_id": tenant,
                "reply_to": f"_INBOX_{tenant}.r",
                "sampling": SamplingParams(max_tokens=BASE_TOKENS, temperature=0, ignore_eos=True),
            }
        )

    prompts = PromptIds.for_model(loaded.tokenizer, loaded.directory)
    server = RequestServer(engine, prompts, "w1", loaded.name, emit, audit, max_waiting=16)
    try:
        await server.accept(of("a"))
        await server.accept(of("b"))
        assert set(server.tasks) == {("a", "same-id"), ("b", "same-id")}
        deadline = time.monotonic() + 60
        while not any(inbox == "_INBOX_a.r" and isinstance(m, ReplyToken) for inbox, m in events):
            assert time.monotonic() < deadline, "no token for a"
            await asyncio.sleep(0.01)
        assert server.cancel(RequestRef("a", "same-id"))
        while server.tasks:
            assert time.monotonic() < deadline, "a request never ended"
            await asyncio.sleep(0.01)
        finals = {inbox: m for inbox, m in events if isinstance(m, ReplyFinal)}
        assert (
            finals["_INBOX_b.r"].finish_reason == "length"
            and finals["_INBOX_b.r"].usage.completion_tokens == BASE_TOKENS
        )
        assert "_INBOX_a.r" not in finals
        assert sorted((r.tenant_id, r.request_id, r.outcome) for r in audits) == [
            ("a", "same-id", "cancelled"),
            ("b", "same-id", "length"),
        ]
    finally:
        engine.shutdown()


def _adapter_series(family: str) -> dict[str, float]:
    """``<family>_count`` by its adapter label, scraped from the exposition text."""
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for metric in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in metric.samples:
            if sample.name == f"{family}_count":
                counts[sample.labels["adapter"]] = sample.value
    return counts


@pytest.mark.parametrize("labels", [1, 2])
async def test_per_adapter_series_stop_at_the_configured_count_and_the_rest_read_other(
    loaded, cold_adapter, labels: int
):
    manager = AdapterManager(
        LoraConfig(
            rank_classes=(8,), memory_budget_bytes=2**24, max_slots_per_class=2, target_modules=("q_proj", "v_proj")
        ),
        ModelShapes.from_hf_config(loaded.model.config),
    )
    cache = CacheHierarchy(manager, lambda _key: manager.read_adapter(cold_adapter), CacheConfig())
    engine = AsyncEngine.from_loaded(
        loaded,
        EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256),
        adapter_manager=manager,
    )
    engine.start()
    finals: list[str] = []
    server = _server(loaded, engine, finals, cache=cache, adapter_metric_labels=labels)
    before = {family: _adapter_series(family) for family in ("adapter_ttft_ms", "adapter_tpot_ms")}
    try:
        for rid, adapter in ((f"base-{labels}", False), (f"cold-{labels}", True)):  # base first: it takes a label
            await server.accept(request(loaded, rid, adapter=adapter))
            deadline = time.monotonic() + 60
            while f"_INBOX.{rid}" not in finals:
                assert time.monotonic() < deadline, f"{rid} never finished"
                await asyncio.sleep(0.01)
        while server.tasks:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    finally:
        cache.close()
        engine.shutdown()
    for family, earlier in before.items():
        after = _adapter_series(family)
        grew = {
            label: after[label] - earlier.get(label, 0.0) for label in after if after[label] > earlier.get(label, 0)
        }
        adapter_label = "other" if labels == 1 else next(label for label in grew if label not in ("base", "other"))
        assert grew == {"base": 1, adapter_label: 1}, (family, grew)
        assert "cold" in adapter_label or labels == 1, adapter_label


def _quota_request(loaded: LoadedModel, rid: str, tenant: str, adapter: str, enforce: str, tokens: int) -> InferRequest:
    resolved = ResolvedAdapter(adapter_id=adapter, version=1, rank=8, digest=DIGEST, storage_uri="test://x", alpha=16)
    return InferRequest(
        request_id=rid, tenant_id=tenant, model="m", base_model=loaded.name, adapter=resolved,
        prompt="Once upon a time", reply_to=f"_INBOX.{rid}", tenant_gpu_slots=1, tenant_slot_enforce=enforce,
        sampling=SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True),
    )  # fmt: skip


@pytest.mark.parametrize("enforce", ["soft", "hard"])
async def test_a_hard_quota_request_waits_for_its_tenants_own_slot_on_the_serving_path(
    loaded, cold_adapter, enforce: str
):
    """Two rank-8 slots: another tenant's idle adapter and acme's running one. acme's second adapter (quota 1)
    evicts the other tenant's under soft; under hard it waits until acme's own running request ends."""
    from prometheus_client import REGISTRY

    manager = AdapterManager(
        LoraConfig(
            rank_classes=(8,), memory_budget_bytes=2**24, max_slots_per_class=2, target_modules=("q_proj", "v_proj")
        ),
        ModelShapes.from_hf_config(loaded.model.config),
    )
    cache = CacheHierarchy(manager, lambda _key: manager.read_adapter(cold_adapter), CacheConfig(policy="lru"))
    engine = AsyncEngine.from_loaded(
        loaded,
        EngineConfig(kv_cache_bytes=32 * 2**20, max_model_len=256, max_num_batched_tokens=256),
        adapter_manager=manager,
    )
    engine.start()
    finals: list[str] = []
    server = _server(loaded, engine, finals, cache=cache)
    waits = REGISTRY.get_sample_value("adapter_quota_waits_total") or 0.0

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + 60
        while not condition():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.01)

    try:
        await server.accept(_quota_request(loaded, "o", "other", "o", "soft", 2))
        await until(lambda: "_INBOX.o" in finals, "the other tenant's request never finished")
        await server.accept(_quota_request(loaded, "a1", "acme", "a1", enforce, 240))  # runs for the whole test
        await until(lambda: "a1@1" in cache.stats().gpu_adapters, "acme's first adapter never loaded")
        await server.accept(_quota_request(loaded, "a2", "acme", "a2", enforce, 2))
        if enforce == "soft":
            await until(lambda: "_INBOX.a2" in finals, "soft: a2 never ran")
            assert set(cache.stats().gpu_adapters) == {"a1@1", "a2@1"}  # the other tenant's adapter left
            assert "_INBOX.a1" not in finals
        else:
            await until(lambda: cache.stats().waiting_for_slot == 1, "hard: a2 never queued for acme's own slot")
            assert set(cache.stats().gpu_adapters) == {"o@1", "a1@1"} and "_INBOX.a1" not in finals
            assert (REGISTRY.get_sample_value("adapter_quota_waits_total") or 0.0) == waits + 1
            assert server.cancel(RequestRef("acme", "a1"))  # acme's own slot frees: a2 takes it, not o's
            await until(lambda: "_INBOX.a2" in finals, "hard: a2 never ran once acme's slot freed")
            assert set(cache.stats().gpu_adapters) == {"o@1", "a2@1"}
        server.cancel(RequestRef("acme", "a1"))
        await until(lambda: not server.tasks, "requests left running")
    finally:
        cache.close()
        engine.shutdown()
