"""Adapter cache tiers: GPU slots <- CPU memory <- trusted store, with pluggable eviction policies."""

from services.worker.cache.config import CacheConfig
from services.worker.cache.cpu_tier import CpuTier
from services.worker.cache.hierarchy import CacheHierarchy, Lookup
from services.worker.cache.loader import LoadFromStore
from services.worker.cache.policy import Entry, EvictionPolicy, HeatPolicy, LfuPolicy, LruPolicy, make_policy
from services.worker.cache.slot_tier import SlotTier
from services.worker.cache.stats import CacheStats

__all__ = [
    "CacheConfig",
    "CacheHierarchy",
    "CacheStats",
    "CpuTier",
    "Entry",
    "EvictionPolicy",
    "HeatPolicy",
    "LfuPolicy",
    "LoadFromStore",
    "Lookup",
    "LruPolicy",
    "SlotTier",
    "make_policy",
]
