"""The cache hierarchy over a real AdapterManager and real PEFT adapters: tiers, sharing, queueing, failures."""

import dataclasses
import hashlib
import random
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.worker.adapter_cache import CacheConfig, CacheHierarchy
from services.worker.lora import AdapterManager, AdapterWeights, LoraConfig, ModelShapes
from shared.adapter_format import WEIGHTS_FILE
from shared.errors import AdapterRevoked, IntegrityError, ServiceUnavailable
from tests.helpers.adapters import save_peft_adapter, tiny_llama, tiny_llama_config

SHAPES = ModelShapes.from_hf_config(tiny_llama_config())
RANK8 = [f"r8-{i}@1" for i in range(6)]
RANK16 = ["r16-0@1", "r16-1@1", "r16-0@2"]
WAIT = 30.0


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("adapters"), tiny_llama()
    keys = [(key, 8) for key in RANK8] + [(key, 16) for key in RANK16]
    return {key: save_peft_adapter(root / key, base, rank=rank, seed=i) for i, (key, rank) in enumerate(keys)}


class Store:
    """load_from_store over real PEFT dirs: counts fetches, can hold them at a gate, fails 'bad' keys."""

    def __init__(self, manager: AdapterManager, dirs: dict[str, Path]):
        self.manager, self.dirs = manager, dirs
        self.fetches: Counter[str] = Counter()
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()

    def __call__(self, key: str) -> AdapterWeights:
        with self._lock:
            self.fetches[key] += 1
        assert self.gate.wait(WAIT)
        if key.startswith("bad"):
            raise IntegrityError(f"{key}: adapter_model.safetensors sha256 does not match")
        return dataclasses.replace(self.manager.read_adapter(self.dirs[key]), digest=weights_digest(self.dirs[key]))


def weights_digest(directory: Path) -> str:
    return hashlib.sha256((directory / WEIGHTS_FILE).read_bytes()).hexdigest()


@pytest.fixture
def manager() -> AdapterManager:
    """2 rank-8 slots, 1 rank-16 slot, q,v targets."""
    lora = LoraConfig(rank_classes=(8, 16), memory_budget_bytes=2**16, max_slots_per_class=2,
                      target_modules=("q_proj", "v_proj"))  # fmt: skip
    return AdapterManager(lora, SHAPES)


@pytest.fixture
def store(manager: AdapterManager, adapter_dirs: dict[str, Path]) -> Store:
    return Store(manager, adapter_dirs)


@pytest.fixture
def cache(manager: AdapterManager, store: Store, request: pytest.FixtureRequest) -> Iterator[CacheHierarchy]:
    """LRU in both tiers unless the test says otherwise."""
    options = getattr(request, "param", {})
    config = CacheConfig(**{"policy": "lru", "cpu_policy": "lru", "load_threads": 2, **options})
    hierarchy = CacheHierarchy(manager, store, config)
    yield hierarchy
    hierarchy.close()


def test_tiny_pool_shape(cache: CacheHierarchy) -> None:
    assert {c.rank: c.slots for c in cache.manager.stats().classes} == {8: 2, 16: 1}


def test_miss_loads_then_hits_and_slot_of_serves_the_engine(cache: CacheHierarchy) -> None:
    gpu_lookups = REGISTRY.get_sample_value("adapter_cache_lookups_total", {"tier": "gpu"}) or 0.0
    first = cache.acquire(RANK8[0], rank=8, tenant="t1")
    assert first.tier == "miss" and not first.hit
    slot = first.ready.result(WAIT).slot
    assert cache.manager.slot_of(RANK8[0]) == slot
    again = cache.acquire(RANK8[0], rank=8, tenant="t1")
    assert again.hit and again.ready.result(0).slot == slot
    cache.release(RANK8[0])
    cache.release(RANK8[0])
    stats = cache.stats()
    assert stats.lookups == {"miss": 1, "gpu": 1} and stats.hit_ratio["gpu"] == 0.5
    assert stats.loads == {"store": 1} and stats.gpu_adapters == [RANK8[0]] == stats.cpu_adapters
    assert REGISTRY.get_sample_value("adapter_cache_lookups_total", {"tier": "gpu"}) == gpu_lookups + 1
    assert REGISTRY.get_sample_value("adapter_slot_occupancy_ratio", {"rank_class": "8"}) == 0.5
    with pytest.raises(KeyError):
        cache.release(RANK8[0])


def test_the_digest_travels_with_the_weights_into_the_slot(
    cache: CacheHierarchy, adapter_dirs: dict[str, Path]
) -> None:
    """Store, CPU tier, slot: a lookup resolves to the digest of the weights its slot holds, whichever tier
    they came from, and another adapter's load never lends it its own."""
    digest = weights_digest(adapter_dirs[RANK8[0]])
    assert cache.acquire(RANK8[0], 8).ready.result(WAIT).digest == digest  # from the store
    assert cache.acquire(RANK8[0], 8).ready.result(0).digest == digest  # a hit
    cache.release(RANK8[0])
    cache.release(RANK8[0])
    for key in RANK8[1:3]:  # LRU evicts RANK8[0]'s slot; its CPU copy stays
        assert cache.acquire(key, 8).ready.result(WAIT).digest == weights_digest(adapter_dirs[key]) != digest
        cache.release(key)
    lookup = cache.acquire(RANK8[0], 8)
    assert lookup.tier == "cpu" and lookup.ready.result(WAIT).digest == digest


def test_concurrent_acquires_of_one_cold_adapter_share_one_load(cache: CacheHierarchy, store: Store) -> None:
    store.gate.clear()
    lookups: list = []
    threads = [threading.Thread(target=lambda: lookups.append(cache.acquire(RANK8[1], 8))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.manager.slot_of(RANK8[1]) is None and all(not lookup.ready.done() for lookup in lookups)
    store.gate.set()
    assert len({lookup.ready.result(WAIT).slot for lookup in lookups}) == 1
    assert store.fetches == {RANK8[1]: 1} and cache.stats().in_flight == {RANK8[1]: 8}


def test_an_evicted_adapter_comes_back_from_the_cpu_tier(cache: CacheHierarchy, store: Store) -> None:
    for key in RANK8[:3]:
        cache.acquire(key, 8).ready.result(WAIT)
        cache.release(key)
    assert RANK8[0] not in cache.stats().gpu_adapters  # LRU left for the third
    lookup = cache.acquire(RANK8[0], 8)
    assert lookup.tier == "cpu" and lookup.ready.result(WAIT).slot >= 0
    stats = cache.stats()
    assert store.fetches[RANK8[0]] == 1 and stats.loads == {"store": 3, "cpu": 1}
    assert stats.evictions == {"gpu/capacity": 2} and set(stats.load_ms_mean) == {"store", "cpu"}


def test_full_rank_class_queues_loads_and_drains_them_in_order(cache: CacheHierarchy) -> None:
    held = RANK8[:2]
    for key in held:
        cache.acquire(key, 8).ready.result(WAIT)  # both rank-8 slots in flight
    order: list[str] = []
    waiting = {key: cache.acquire(key, 8).ready for key in RANK8[2:5]}
    for key, future in waiting.items():
        future.add_done_callback(lambda _, key=key: order.append(key))
    other = cache.acquire(RANK16[0], 16)  # another rank class is not held up
    assert other.ready.result(WAIT).slot >= 0
    _wait_for(lambda: cache.stats().waiting_for_slot == 3)
    assert not any(f.done() for f in waiting.values()) and set(cache.stats().gpu_adapters) >= set(held)
    cache.release(held[0])
    waiting[RANK8[2]].result(WAIT)
    cache.release(held[1])
    waiting[RANK8[3]].result(WAIT)
    cache.release(RANK8[2])
    waiting[RANK8[4]].result(WAIT)
    assert order == RANK8[2:5]
    stats = cache.stats()
    assert stats.waiting_for_slot == 0 and stats.slot_wait_ms_mean > 0
    assert set(stats.gpu_adapters) == {RANK8[3], RANK8[4], RANK16[0]}


def test_a_failing_load_reaches_every_waiter_and_is_retried_later(cache: CacheHierarchy, store: Store) -> None:
    store.gate.clear()
    lookups = [cache.acquire("bad@1", 8) for _ in range(3)]
    store.gate.set()
    for lookup in lookups:
        with pytest.raises(IntegrityError, match="sha256"):
            lookup.ready.result(WAIT)
    assert cache.stats().loading == [] and cache.manager.resident() == {}
    with pytest.raises(IntegrityError):
        cache.acquire("bad@1", 8).ready.result(WAIT)
    assert store.fetches["bad@1"] == 2


def test_invalidate_evicts_from_both_tiers_and_drains_in_flight(cache: CacheHierarchy) -> None:
    for key in ("r16-0@1", "r8-0@1"):
        cache.acquire(key, 8).ready.result(WAIT)
        cache.release(key)
    busy = cache.acquire("r16-0@2", 16)  # evicts r16-0@1 from the single rank-16 slot, stays in flight
    busy.ready.result(WAIT)
    assert {"r16-0@1", "r16-0@2"} <= set(cache.stats().cpu_adapters)
    assert cache.invalidate("r16-0") == ["r16-0@1", "r16-0@2"]
    stats = cache.stats()
    assert not {"r16-0@1", "r16-0@2"} & set(stats.cpu_adapters)
    assert cache.manager.slot_of("r16-0@2") is not None  # its request is still running
    with pytest.raises(AdapterRevoked):
        cache.acquire("r16-0@2", 16)
    cache.release("r16-0@2")
    assert cache.manager.slot_of("r16-0@2") is None and "r16-0@2" not in cache.stats().gpu_adapters
    assert cache.stats().evictions["gpu/invalidated"] == 1 and cache.stats().evictions["cpu/invalidated"] == 2
    assert cache.invalidate("r8-0", version=2) == [] and cache.invalidate("r8-0", version=1) == ["r8-0@1"]
    assert cache.manager.resident() == {}


def test_invalidate_fails_a_pending_load(cache: CacheHierarchy, store: Store) -> None:
    store.gate.clear()
    lookup = cache.acquire(RANK8[0], 8)
    assert cache.invalidate("r8-0") == [RANK8[0]]
    store.gate.set()
    with pytest.raises(AdapterRevoked):
        lookup.ready.result(WAIT)
    _wait_for(lambda: RANK8[0] not in cache.stats().cpu_adapters and cache.manager.resident() == {})


@pytest.mark.parametrize("cache", [{"warmup": (RANK8[0], RANK16[1])}], indirect=True)
def test_warmup_prefetch_evict_and_pins(cache: CacheHierarchy) -> None:
    cache.start()
    _wait_for(lambda: set(cache.manager.resident()) == {RANK8[0], RANK16[1]})
    assert cache.acquire(RANK8[0], 8).hit
    assert cache.evict(RANK8[0]) == "in_flight"
    cache.release(RANK8[0])
    cache.pin(RANK8[0])
    assert cache.evict(RANK8[0]) == "pinned"
    assert cache.evict(RANK8[3]) == "not_resident"
    assert cache.prefetch(RANK8[1]) and not cache.prefetch(RANK8[0])
    _wait_for(lambda: RANK8[1] in cache.manager.resident())
    assert cache.prefetch(RANK8[2])  # no free slot and LRU scores a never-requested key lowest: CPU only
    _wait_for(lambda: RANK8[2] in cache.stats().cpu_adapters and not cache.stats().loading)
    assert RANK8[2] not in cache.manager.resident() and RANK8[0] in cache.manager.resident()
    cache.unpin(RANK8[0])
    assert cache.evict(RANK8[0]) == "done" and RANK8[0] in cache.stats().cpu_adapters
    assert cache.evict(RANK8[0]) == "not_resident"


@pytest.mark.parametrize("cache", [{"policy": "heat", "load_threads": 3}], indirect=True)
def test_random_churn_never_evicts_in_flight_or_pinned(cache: CacheHierarchy) -> None:
    rng, model, pins = random.Random(7), Counter[str](), set[str]()
    violations: list[str] = []
    unload = cache.manager.unload

    def checked_unload(name: str) -> None:
        if name in pins or model[name] > 0:
            violations.append(name)
        unload(name)

    cache.manager.unload = checked_unload  # type: ignore[method-assign]
    keys = RANK8 + RANK16[:2]
    futures: list[Future[int]] = []
    for step in range(400):
        key, op = rng.choice(keys), rng.random()
        if op < 0.45:
            futures.append(cache.acquire(key, 16 if key.startswith("r16") else 8).ready)
            model[key] += 1
        elif op < 0.85 and +model:
            key = rng.choice(sorted(+model))
            model[key] -= 1
            cache.release(key)
        elif op < 0.9 and len(pins) < 1 and cache.pin(key):  # a rank class's last slot is never pinned
            pins.add(key)
        elif op < 0.95 and pins:
            key = pins.pop()
            cache.unpin(key)
        else:
            cache.evict(key)
        if step % 50 == 0:
            cache.update_heat({k: rng.random() for k in keys})
    for key, count in (+model).items():
        for _ in range(count):
            model[key] -= 1
            cache.release(key)
    assert all(isinstance(f.result(WAIT).slot, int) for f in futures)  # nothing starved, nothing failed
    stats = cache.stats()
    assert violations == [] and stats.in_flight == {} and stats.waiting_for_slot == 0
    assert set(stats.gpu_adapters) == set(cache.manager.resident()) and set(pins) <= set(stats.gpu_adapters)


def _quota_waits() -> float:
    return REGISTRY.get_sample_value("adapter_quota_waits_total") or 0.0


@pytest.mark.parametrize("enforce", ["soft", "hard"])
def test_a_hard_quota_tenant_waits_for_its_own_slot_and_never_evicts_another_tenants(
    cache: CacheHierarchy, enforce: str
) -> None:
    hard, waits = enforce == "hard", _quota_waits()
    cache.acquire(RANK8[0], 8, tenant="other").ready.result(WAIT)
    cache.release(RANK8[0])  # idle, and the coldest: LRU's first victim
    cache.acquire(RANK8[1], 8, tenant="acme", slot_limit=1, hard=hard).ready.result(
        WAIT
    )  # acme at its quota, in flight
    waiting = cache.acquire(RANK8[2], 8, tenant="acme", slot_limit=1, hard=hard)
    if not hard:  # soft: none of its own can go, so the other tenant's colder adapter leaves
        waiting.ready.result(WAIT)
        assert RANK8[0] not in cache.manager.resident() and _quota_waits() == waits
        return
    _wait_for(lambda: cache.stats().waiting_for_slot == 1)
    assert not waiting.ready.done() and RANK8[0] in cache.manager.resident()
    assert _quota_waits() == waits + 1
    third = cache.acquire(RANK8[3], 8, tenant="third")  # a load behind the waiting one is not held up by it
    third.ready.result(WAIT)
    assert RANK8[0] not in cache.manager.resident() and not waiting.ready.done()
    fourth = cache.acquire(RANK8[4], 8, tenant="fourth")  # every slot in flight: it queues behind acme's
    _wait_for(lambda: cache.stats().waiting_for_slot == 2)
    cache.release(RANK8[3])  # a slot acme may not take frees: the load queued behind acme's gets it
    fourth.ready.result(WAIT)
    assert not waiting.ready.done()
    cache.release(RANK8[1])  # acme's own slot frees: its waiting load takes it, evicting only its own
    waiting.ready.result(WAIT)
    assert set(cache.manager.resident()) == {RANK8[2], RANK8[4]}
    assert cache.stats().evictions == {"gpu/capacity": 3}


def test_a_hard_quota_tenant_at_its_quota_takes_no_free_slot_but_its_own(cache: CacheHierarchy) -> None:
    cache.acquire(RANK8[0], 8, tenant="acme", slot_limit=1, hard=True).ready.result(WAIT)
    cache.release(RANK8[0])
    cache.acquire(RANK8[1], 8, tenant="acme", slot_limit=1, hard=True).ready.result(WAIT)
    assert set(cache.manager.resident()) == {RANK8[1]}  # a slot stays free for the others
    cache.acquire(RANK8[2], 8, tenant="other").ready.result(WAIT)
    assert set(cache.manager.resident()) == {RANK8[1], RANK8[2]}


def test_pins_take_every_slot_of_a_class_but_one_and_report_the_rest(cache: CacheHierarchy) -> None:
    assert cache.pin(RANK8[0], 8, "acme")
    assert not cache.pin(RANK8[1], 8, "acme")  # the second rank-8 slot stays for unpinned adapters
    assert not cache.pin(RANK16[0], 16)  # the one rank-16 slot likewise
    _wait_for(lambda: RANK8[0] in cache.manager.resident())  # pinned while absent: loaded, and kept
    stats = cache.stats()
    assert stats.pinned == [RANK8[0]] and stats.pins_refused == sorted([RANK8[1], RANK16[0]])
    for key in RANK8[1:4]:
        cache.acquire(key, 8).ready.result(WAIT)
        cache.release(key)
    assert RANK8[0] in cache.manager.resident()
    cache.unpin(RANK8[0])
    assert cache.pin(RANK8[1], 8) and cache.stats().pins_refused == [RANK16[0]]


def _wait_for(condition, timeout: float = WAIT) -> None:  # type: ignore[no-untyped-def]
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError("condition not met in time")


def test_a_version_invalidated_mid_copy_is_undone_before_it_loads_again(cache: CacheHierarchy) -> None:
    gate, undone = threading.Event(), threading.Event()
    copy, unload = cache.manager.load_adapter, cache.manager.unload

    def gated_copy(name: str, source: AdapterWeights) -> int:
        assert gate.wait(WAIT)
        return copy(name, source)

    def watched_unload(name: str) -> None:
        unload(name)
        undone.set()

    cache.manager.load_adapter = gated_copy  # type: ignore[method-assign]
    cache.manager.unload = watched_unload  # type: ignore[method-assign]
    lookup = cache.acquire(RANK8[0], 8)
    _wait_for(lambda: cache.stats().slots[8][0] == 0 and RANK8[0] in cache.stats().cpu_adapters)
    assert cache.invalidate("r8-0") == [RANK8[0]]
    with pytest.raises(AdapterRevoked):
        lookup.ready.result(WAIT)
    with pytest.raises(AdapterRevoked):
        cache.acquire(RANK8[0], 8)  # the revoked copy has not landed yet
    gate.set()
    assert undone.wait(WAIT) and cache.manager.resident() == {}
    cache.release(RANK8[0])
    assert cache.acquire(RANK8[0], 8).ready.result(WAIT).slot >= 0  # a fresh load, verified again by the store


def test_close_fails_loads_that_never_ran(cache: CacheHierarchy, store: Store) -> None:
    store.gate.clear()
    lookups = [cache.acquire(key, 8) for key in RANK8[:3]]  # two fetches hold both threads, one is queued
    threading.Timer(0.5, store.gate.set).start()
    cache.close()
    with pytest.raises(ServiceUnavailable, match="shutting down"):
        lookups[2].ready.result(WAIT)
    assert all(lookup.ready.result(WAIT).slot >= 0 for lookup in lookups[:2])


def test_a_tenant_past_its_cpu_share_evicts_its_own_cpu_copies(
    manager: AdapterManager, store: Store, adapter_dirs: dict[str, Path]
) -> None:
    """Issue 47: acme's stream of adapters used to push globex's colder CPU copy out of the tier."""
    size = manager.read_adapter(adapter_dirs[RANK8[0]]).nbytes
    config = CacheConfig(policy="lru", cpu_policy="lru", cpu_budget_bytes=4 * size, tenant_cpu_share=0.5)
    cache = CacheHierarchy(manager, store, config)
    try:
        for key, tenant in [(RANK8[3], "globex"), (RANK8[0], "acme"), (RANK8[1], "acme"), (RANK8[2], "acme"),
                            (RANK8[4], "acme")]:  # fmt: skip
            cache.acquire(key, 8, tenant).ready.result(WAIT)
            cache.release(key)
        stats = cache.stats()
        assert sorted(stats.cpu_adapters) == sorted([RANK8[3], RANK8[1], RANK8[2], RANK8[4]])
        assert stats.evictions.get("cpu/capacity") == 1 and stats.cpu_bytes == 4 * size
    finally:
        cache.close()
