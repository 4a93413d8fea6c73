"""Rank pools in placement: a pooled adapter goes to its pool, spills when the pool is saturated,
and other traffic keeps off the pool while the rest of the fleet has room."""

from services.scheduler.placement import Fleet
from shared.schemas import InferRequest, ResolvedAdapter, WorkerHeartbeat

BASE = "base"
CLASSES = {"8": [0, 8], "16": [0, 8], "32": [0, 8], "64": [0, 8]}


def beat(worker_id: str, pool: tuple[int, ...] = (), running: int = 0, ready: bool = True) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        base_model=BASE,
        ready=ready,
        running=running,
        waiting=0,
        max_running=4,
        kv_blocks_free=100,
        kv_blocks_total=100,
        slots=CLASSES,
        rank_pool=list(pool),
    )


def req(rank: int | None, adapter: str = "ad", rid: str = "r") -> InferRequest:
    resolved = (
        ResolvedAdapter(adapter_id=adapter, version=1, rank=rank, digest="0" * 64, storage_uri="x", alpha=16)
        if rank is not None
        else None
    )
    return InferRequest(
        request_id=rid, tenant_id="t", model=BASE, base_model=BASE, prompt="hi", reply_to="_INBOX.a", adapter=resolved
    )


def fleet(*beats: WorkerHeartbeat) -> Fleet:
    f = Fleet(timeout_s=5, headroom=2)
    for b in beats:
        f.heartbeat(b, now=0)
    return f


def test_rank_64_adapters_go_to_the_high_rank_pool_and_rank_8_ones_elsewhere():
    f = fleet(beat("high", pool=(64,)), beat("low-a"), beat("low-b"))
    for i in range(20):
        # many adapters: rendezvous homes would spread them over all three workers without pools
        assert f.choose(req(64, adapter=f"big{i}"), now=0) == "high"
        assert f.choose(req(40, adapter=f"mid{i}"), now=0) == "high"  # rank 40 lives in class 64
        assert f.choose(req(8, adapter=f"small{i}"), now=0) in {"low-a", "low-b"}
        assert f.choose(req(None), now=0) in {"low-a", "low-b"}
    assert f.spilled_from(req(64), "high") is None


def test_a_busier_pool_worker_still_beats_an_idle_one_outside_the_pool():
    f = fleet(beat("high", pool=(64,), running=3), beat("low"))
    assert f.choose(req(64), now=0) == "high"


def test_a_saturated_pool_spills_to_other_capable_workers_and_says_so():
    f = fleet(beat("high", pool=(64,), running=4), beat("low"))
    assert f.choose(req(64), now=0) == "low"
    assert f.spilled_from(req(64), "low") == 64
    assert f.spilled_from(req(8), "low") is None  # not pooled: no spill


def test_every_pool_worker_must_be_saturated_before_a_spill():
    f = fleet(beat("high-a", pool=(32, 64), running=4), beat("high-b", pool=(32, 64), running=2), beat("low"))
    assert f.choose(req(32), now=0) == "high-b"
    f.heartbeat(beat("high-b", pool=(32, 64), running=4), now=1)
    assert f.choose(req(32), now=1) == "low"


def test_with_the_whole_fleet_saturated_the_pool_takes_its_own_first():
    f = fleet(beat("high", pool=(64,), running=4), beat("low", running=4))
    assert f.choose(req(64), now=0) == "high"
    assert f.choose(req(8), now=0) == "low"


def test_low_rank_traffic_keeps_off_the_pool_while_the_others_have_room():
    f = fleet(beat("high", pool=(64,)), beat("low", running=4))
    assert f.choose(req(8), now=0) == "low"  # saturated but within its headroom
    f.heartbeat(beat("low", running=6), now=1)  # past max_running + headroom: no room at all
    assert f.choose(req(8), now=1) == "high"


def test_a_pool_with_no_live_worker_is_no_pool():
    f = fleet(beat("high", pool=(64,), ready=False), beat("low-a"), beat("low-b", running=3))
    assert f.choose(req(64), now=0) == "low-a"
    assert f.spilled_from(req(64), "low-a") is None
    f.heartbeat(beat("high", pool=(64,)), now=1)
    assert f.choose(req(64), now=1) == "high"


def test_without_pools_placement_is_as_before():
    f = fleet(beat("a"), beat("b", running=1))
    assert f.choose(req(64), now=0) == "a"
    assert f.spilled_from(req(64), "b") is None
