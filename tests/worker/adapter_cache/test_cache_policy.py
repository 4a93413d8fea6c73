"""Eviction policies replayed on fixed traces (exact hit counts), quotas, SLO classes, heat, CPU tier budget."""

import math

import pytest
import torch
from pydantic import ValidationError

from services.worker.adapter_cache import CacheConfig, CpuTier, Entry, HeatPolicy, LfuPolicy, LruPolicy, SlotTier
from services.worker.adapter_cache.policy import EvictionPolicy
from services.worker.lora import AdapterWeights
from shared.decay import DecayedRate

SHIFT = "AAAABCA" + "DEDEDEDEDE"  # A hot, a two-key scan, then A goes cold and D, E rise


def replay(policy: EvictionPolicy, trace: str, slots: int) -> int:
    """GPU-tier hits of ``trace`` (one request per time unit) through the worker's SlotTier."""
    tier, hits = SlotTier({8: slots}, policy), 0
    for now, key in enumerate(trace):
        policy.touch(key, now)
        if key in tier:
            hits += 1
            continue
        if tier.free(8) == 0:
            victim = tier.victim(Entry(key, 8), now, protected=lambda _: False)
            assert victim is not None
            tier.remove(victim.key)
        tier.reserve(8)
        tier.commit(Entry(key, 8))
    return hits


@pytest.mark.parametrize(
    ("trace", "expected"),
    [("AAAABCA", {"lru": 3, "lfu": 4, "heat": 4}), (SHIFT, {"lru": 11, "lfu": 4, "heat": 11})],
)
def test_fixed_trace_hits(trace: str, expected: dict[str, int]) -> None:
    # LRU drops hot A for the scan; LFU keeps A after it went cold and misses all of D/E;
    # heat (half-life 2) keeps A through the scan and hands its slot to D, E three requests later.
    policies = {"lru": LruPolicy(), "lfu": LfuPolicy(), "heat": HeatPolicy(half_life_s=2.0, heat_weight=0.0)}
    assert {name: replay(policy, trace, slots=2) for name, policy in policies.items()} == expected


def test_short_half_life_behaves_like_lru() -> None:
    assert replay(HeatPolicy(half_life_s=0.5), "AAAABCA", slots=2) == replay(LruPolicy(), "AAAABCA", slots=2)


def test_fleet_heat_keeps_a_locally_cold_adapter() -> None:
    policy = HeatPolicy(half_life_s=10.0, heat_weight=1.0)
    for now, key in enumerate("ABB"):
        policy.touch(key, now)
    a, b = Entry("A", 8), Entry("B", 8)
    assert policy.victim([a, b], now=3.0) == a
    policy.update_heat({"A": 5.0})
    assert policy.victim([a, b], now=3.0) == b


def test_batch_adapters_leave_before_interactive_at_equal_heat() -> None:
    policy = HeatPolicy(half_life_s=10.0, batch_weight=0.5)
    policy.touch("I", 0.0)
    policy.touch("B", 0.0)
    interactive, batch = Entry("I", 8, slo="interactive"), Entry("B", 8, slo="batch")
    assert policy.victim([interactive, batch], now=1.0) == batch
    for now in range(1, 4):  # batch three times as hot: its halved score still wins
        policy.touch("B", float(now))
    assert policy.victim([interactive, batch], now=4.0) == interactive


def test_tenant_over_quota_evicts_its_own_coldest_first() -> None:
    tier = SlotTier({8: 4}, LruPolicy(), quota=CacheConfig(tenant_slot_share=0.5).slot_quota)
    entries = [Entry("t1-a", 8, "t1"), Entry("t2-a", 8, "t2"), Entry("t1-b", 8, "t1"), Entry("t2-b", 8, "t2")]
    for now, entry in enumerate(entries):
        tier.policy.touch(entry.key, now)
        tier.reserve(8)
        tier.commit(entry)
    # t1 holds its quota (2 of 4): its own coldest leaves although t2-a is colder overall
    assert tier.victim(Entry("t1-c", 8, "t1"), 9.0, protected=lambda _: False) == entries[0]
    assert tier.victim(Entry("t3-a", 8, "t3"), 9.0, protected=lambda _: False) == entries[0]
    # the own candidates are all protected: the quota yields rather than block the load
    protected = {"t1-a", "t1-b"}.__contains__
    assert tier.victim(Entry("t1-c", 8, "t1"), 9.0, protected=protected) == entries[1]


def test_the_tenants_own_slot_limit_tightens_the_configured_share() -> None:
    tier = SlotTier({8: 4}, LruPolicy(), quota=CacheConfig(tenant_slot_share=1.0).slot_quota)
    entries = [Entry("t2-a", 8, "t2"), Entry("t1-a", 8, "t1"), Entry("t2-b", 8, "t2")]
    for now, entry in enumerate(entries):
        tier.policy.touch(entry.key, now)
        tier.reserve(8)
        tier.commit(entry)
    # by the config share t1 may hold all 4 slots: the coldest overall (t2-a) leaves
    assert tier.victim(Entry("t1-b", 8, "t1"), 9.0, protected=lambda _: False) == entries[0]
    # with its quota of 1 slot from the tenant's limits, t1 evicts its own adapter first
    assert tier.victim(Entry("t1-b", 8, "t1", slot_limit=1), 9.0, protected=lambda _: False) == entries[1]


def test_protected_entries_are_never_victims() -> None:
    tier = SlotTier({8: 2}, LruPolicy())
    for now, key in enumerate("AB"):
        tier.policy.touch(key, now)
        tier.reserve(8)
        tier.commit(Entry(key, 8))
    assert tier.victim(Entry("C", 8), 3.0, protected={"A"}.__contains__) == Entry("B", 8)
    assert tier.victim(Entry("C", 8), 3.0, protected={"A", "B"}.__contains__) is None


def test_rank_classes_and_reservations() -> None:
    tier = SlotTier({16: 1, 8: 2}, LruPolicy())
    assert [tier.class_of(r) for r in (1, 8, 9, 16)] == [8, 8, 16, 16]
    tier.reserve(16)
    assert tier.free(16) == 0 and tier.free(8) == 2
    with pytest.raises(RuntimeError):
        tier.reserve(16)
    with pytest.raises(Exception, match="above the admitted maximum 16"):
        tier.class_of(17)


def test_decayed_rate_converges_to_the_request_rate_and_halves() -> None:
    rate = DecayedRate(half_life_s=5.0)
    for i in range(2000):
        rate.bump("k", i * 0.1)  # 10 requests/s
    assert rate.rate("k", 199.9) == pytest.approx(10.0, rel=0.05)
    assert rate.rate("k", 204.9) == pytest.approx(rate.rate("k", 199.9) / 2)
    rate.prune(10_000.0)
    assert rate.snapshot(10_000.0) == {}
    assert math.isclose(rate.rate("missing", 0.0), 0.0)


def weights(nbytes_per_matrix: int) -> AdapterWeights:
    t = torch.zeros(nbytes_per_matrix // 4)
    return AdapterWeights(rank=8, scale=1.0, a={(0, "q_proj"): t}, b={(0, "q_proj"): t.clone()})


def test_cpu_tier_keeps_its_byte_budget_by_its_policy() -> None:
    tier = CpuTier(budget_bytes=2500, policy=LruPolicy())  # two 1000-byte adapters
    for now, key in enumerate("ABC"):
        tier.policy.touch(key, now)
        assert tier.put(Entry(key, 8), weights(500), now) == (["A"] if key == "C" else [])
    assert tier.keys() == ["B", "C"] and tier.nbytes == 2000
    assert tier.put(Entry("huge", 8), weights(4000), 4.0) == [] and "huge" not in tier
    assert tier.remove("B") and not tier.remove("B") and tier.nbytes == 1000


def test_a_tenant_over_its_cpu_share_evicts_its_own_coldest_first() -> None:
    """Issue 47: one tenant's stream of adapters used to flush every other tenant's CPU copies."""
    tier = CpuTier(budget_bytes=4000, policy=LruPolicy(), tenant_share=0.5)  # 1000-byte adapters: 4 fit, 2 each
    for now, (key, tenant) in enumerate([("b1", "b"), ("a1", "a"), ("a2", "a"), ("a3", "a")]):
        tier.policy.touch(key, now)
        assert tier.put(Entry(key, 8, tenant), weights(500), now) == []  # a free tier binds nobody
    assert (tier.tenant_bytes("a"), tier.tenant_bytes("b")) == (3000, 1000)
    tier.policy.touch("a4", 4)
    assert tier.put(Entry("a4", 8, "a"), weights(500), 4) == ["a1"]  # over its share: its own, not b's colder b1
    tier.policy.touch("b2", 5)
    assert tier.put(Entry("b2", 8, "b"), weights(500), 5) == ["a2"]  # a is over its share: a leaves, not b1
    tier.policy.touch("c1", 6)
    assert tier.put(Entry("c1", 8, "c"), weights(500), 6) == ["b1"]  # nobody over: the policy's coldest
    assert sorted(tier.keys()) == ["a3", "a4", "b2", "c1"]
    assert tier.put(Entry("big", 8, "d"), weights(1500), 7) == [] and "big" not in tier  # more than a share
    assert tier.put(Entry("warm", 8), weights(500), 8) == ["a3"]  # a prefetch (no tenant) evicts like the rest


def test_a_full_cpu_share_restores_the_plain_policy() -> None:
    tier = CpuTier(budget_bytes=2000, policy=LruPolicy(), tenant_share=1.0)
    for now, (key, tenant) in enumerate([("b1", "b"), ("a1", "a"), ("a2", "a")]):
        tier.policy.touch(key, now)
        evicted = tier.put(Entry(key, 8, tenant), weights(500), now)
    assert evicted == ["b1"]


@pytest.mark.parametrize(
    "config", [{"policy": "mru"}, {"tenant_cpu_share": 0}, {"tenant_cpu_share": 1.5}, {"load_threads": 0}, {"cpu_budget_bytes": -1}, {"half_life_s": 0},
               {"tenant_slot_shares": {"t": 1.5}}, {"unknown": 1}],
)  # fmt: skip
def test_config_is_bounded_and_frozen(config: dict) -> None:
    with pytest.raises(ValidationError):
        CacheConfig(**config)
    with pytest.raises(ValidationError):
        CacheConfig().load_threads = 4  # type: ignore[misc]
