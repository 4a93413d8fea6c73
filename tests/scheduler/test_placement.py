import time

from services.scheduler.placement import Fleet
from services.scheduler.prefetch import Prefetcher
from shared.request_ref import RequestRef
from shared.schemas import EngineCapability, InferRequest, ResolvedAdapter, WorkerHeartbeat

BASE = "base"
DIGEST = "0" * 64


def beat(
    worker_id: str,
    running: int = 0,
    gpu: tuple[str, ...] = (),
    cpu: tuple[str, ...] = (),
    model: str = BASE,
    kv: int = 100,
    ts: float = 0.0,
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        base_model=model,
        ready=True,
        running=running,
        waiting=0,
        max_running=4,
        kv_blocks_free=kv,
        kv_blocks_total=100,
        resident_adapters=list(gpu),
        cpu_adapters=list(cpu),
        ts=ts,
    )


def req(adapter: str | None = "ad", version: int = 1, rid: str = "r", priority: str | None = None) -> InferRequest:
    resolved = (
        ResolvedAdapter(adapter_id=adapter, version=version, rank=8, digest=DIGEST, storage_uri="x", alpha=16)
        if adapter
        else None
    )
    return InferRequest(
        request_id=rid,
        tenant_id="t",
        model=BASE,
        base_model=BASE,
        prompt="hi",
        reply_to="_INBOX.a",
        adapter=resolved,
        priority=priority,
    )


def fleet(*beats: WorkerHeartbeat) -> Fleet:
    f = Fleet(timeout_s=5, headroom=1)
    for b in beats:
        f.heartbeat(b, now=0)
    return f


def test_residency_wins_gpu_then_cpu_then_load():
    f = fleet(beat("a"), beat("b", running=1, cpu=("ad@1",)), beat("c", running=2, gpu=("ad@1",)))
    assert f.choose(req(), now=0) == "c"
    assert f.choose(req(), exclude={"c"}, now=0) == "b"
    assert f.choose(req(adapter=None), now=0) == "a"  # the base model is resident everywhere: least loaded


def test_interactive_trades_residency_for_a_less_loaded_worker_and_batch_stays_with_the_holder():
    f = fleet(beat("busy", running=3, gpu=("ad@1",)), beat("idle", cpu=("ad@1",)))
    assert f.choose(req(priority="interactive"), now=0) == "idle"  # a CPU-tier copy beats a queue
    assert f.choose(req(priority="batch"), now=0) == "busy"  # no copy, no eviction for a batch request


def test_a_saturated_holder_spills_the_hot_adapter_to_an_idle_worker():
    f = fleet(beat("a"), beat("hot", running=4, gpu=("ad@1",)))
    assert f.choose(req(), now=0) == "a"


def test_no_room_no_wrong_model_no_dead_worker():
    f = fleet(beat("full", running=5), beat("other", model="other-model"))
    assert f.choose(req(), now=0) is None
    f.heartbeat(beat("late"), now=10)
    assert f.expire(now=10) == ["full", "other"]
    assert f.choose(req(), now=10) == "late"


def test_dispatches_since_the_last_heartbeat_count_as_load_and_pin_the_adapter_there():
    f = fleet(beat("a"), beat("b", kv=50))
    first = f.choose(req(), now=0)
    assert first == "a"
    for i in range(2):
        f.sent(first, req(rid=f"r{i}"), now=0)
    assert f.choose(req(), now=1) == "a"  # it is loading ad@1 there: affinity, though b is idler
    for i in range(2, 4):
        f.sent("a", req(rid=f"r{i}"), now=1)
    assert f.choose(req(), now=1) == "b"  # a is full until a request ends or a heartbeat says otherwise
    f.ended("a", RequestRef("t", "r3"))
    assert f.choose(req(), now=1) == "a"
    f.refused("a", "r2", back_off=True)
    assert f.choose(req(), now=1) == "b"
    f.heartbeat(beat("a", gpu=("ad@1",), ts=1e18), now=2)
    assert f.choose(req(), now=2) == "a"


def test_prefetch_replicates_a_rising_adapter_and_evicts_cold_replicas_boundedly():
    f = fleet(beat("a", gpu=("hot@1", "cold@1")), beat("b", gpu=("cold@1",)), beat("c", running=3, cpu=("hot@1",)))
    plan = Prefetcher(hot_rate=1.0, cold_rate=0.01, limit=10).plan({"hot@1": 2.5, "cold@1": 0.0}, f)
    sent = {(w, c.action, c.adapter_id) for w, c in plan}
    assert sent == {("c", "prefetch", "hot"), ("b", "evict", "cold")}  # c holds it in its CPU tier
    prefetcher = Prefetcher(hot_rate=1.0, cold_rate=0.01, limit=1)
    first = prefetcher.plan({"hot@1": 2.5, "cold@1": 0.0}, f)
    second = prefetcher.plan({"hot@1": 2.5, "cold@1": 0.0}, f)
    assert len(first) == len(second) == 1 and first != second  # not the same one tick after tick


def test_a_free_slot_of_the_right_rank_class_beats_a_full_one():
    full = beat("full").model_copy(update={"slots": {"8": [4, 4], "64": [0, 2]}})
    free = beat("free", running=1).model_copy(update={"slots": {"8": [1, 4], "64": [2, 2]}})
    f = fleet(full, free)
    assert f.choose(req(adapter="new-a"), now=0) == "free"  # rank 8: only "free" loads without evicting
    assert f.workers["full"].tier("new-a@1", 0, 8) == "miss"
    assert f.workers["full"].tier("new-a@1", 0, 16) == "free_slot"  # rank 16 fits the empty rank-64 class
    assert f.workers["free"].tier("new-a@1", 0, 16) == "miss"


def _limited(worker_id: str, rank: int | None, modules: tuple[str, ...] = (), running: int = 0) -> WorkerHeartbeat:
    capability = EngineCapability(engine="vllm", max_lora_rank=rank, lora_modules=list(modules))
    return beat(worker_id, running=running).model_copy(update={"capability": capability})


def _adapter_req(rank: int, modules: tuple[str, ...]) -> InferRequest:
    resolved = ResolvedAdapter(
        adapter_id="ad", version=1, rank=rank, digest=DIGEST, storage_uri="x", alpha=16, target_modules=list(modules)
    )
    return req().model_copy(update={"adapter": resolved})


def test_a_worker_whose_engine_cannot_serve_the_rank_or_modules_never_takes_the_adapter():
    qv = ("q_proj", "v_proj")
    f = fleet(_limited("narrow", 16, qv), _limited("wide", 64, running=3))
    assert f.choose(_adapter_req(16, qv), now=0) == "narrow"  # fits both: the idle one
    assert f.choose(_adapter_req(32, qv), now=0) == "wide"  # rank above the narrow engine's limit
    assert f.choose(_adapter_req(8, ("q_proj", "o_proj")), now=0) == "wide"  # a module it does not hold
    assert f.choose(_adapter_req(32, qv), exclude={"wide"}, now=0) is None
    assert f.serves(_adapter_req(32, qv)) and f.serves(req(adapter=None))
    del f.workers["wide"]
    assert not f.serves(_adapter_req(32, qv)) and f.serves(_adapter_req(8, qv))


def test_an_engine_that_announces_no_limits_serves_any_adapter():
    legacy = WorkerHeartbeat.model_validate_json(beat("old").model_dump_json(exclude={"capability"}))
    assert legacy.capability == EngineCapability()  # a heartbeat without the field: the built-in engine, no limit
    f = fleet(legacy, _limited("unknown-modules", 64))
    assert f.choose(_adapter_req(64, ("q_proj", "down_proj")), exclude={"old"}, now=0) == "unknown-modules"
    assert f.choose(_adapter_req(1024, ("q_proj",)), exclude={"unknown-modules"}, now=0) == "old"


def test_a_request_that_ended_after_the_heartbeat_frees_its_sequence_before_the_next_one():
    """The heartbeat counted it as running; its end (worker clock) after that heartbeat takes it off
    the count at once, and the next heartbeat, taken after it ended, replaces the correction."""
    f = Fleet(timeout_s=5, headroom=0)
    f.heartbeat(beat("w", running=4, ts=100.0), now=0)
    assert f.choose(req(), now=0) is None  # 4 of 4 running
    f.workers["w"].inflight = 4
    f.ended("w", RequestRef("t", "old"), at=101.0)
    assert f.workers["w"].load == 3 and f.choose(req(), now=0) == "w"
    f.ended("w", RequestRef("t", "older"), at=99.0)  # ended before the heartbeat: already off its count
    assert f.workers["w"].load == 3
    f.heartbeat(beat("w", running=2, ts=102.0), now=1)  # taken after both ended
    assert f.workers["w"].load == 2
    new = req(rid="new")
    f.sent("w", new)  # sent after that heartbeat: counted as sent, not in the heartbeat
    assert f.workers["w"].load == 3
    f.ended("w", RequestRef.of(new), at=time.time())  # leaves ``sent``; the heartbeat's count stays
    assert f.workers["w"].load == 2


def test_free_sequences_sum_the_room_of_the_workers_that_fit():
    f = fleet(beat("a", running=1), beat("b", running=4), beat("c", running=2), beat("other", model="other-model"))
    assert f.free_sequences(req()) == (4 + 1 - 1) + 1 + (4 + 1 - 2)  # max_running 4, headroom 1
    f.refused("c", RequestRef("t", "x"), back_off=True)
    assert f.free_sequences(req()) == 4 + 1
