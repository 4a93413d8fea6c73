"""Adapter cache tiers: GPU slots <- CPU memory <- trusted store, with pluggable eviction policies."""

from services.worker.adapter_cache.cache_config import CacheConfig
from services.worker.adapter_cache.cpu_tier import CpuTier
from services.worker.adapter_cache.hierarchy import CacheHierarchy, Lookup
from services.worker.adapter_cache.policy import Entry, EvictionPolicy, HeatPolicy, LfuPolicy, LruPolicy, make_policy
from services.worker.adapter_cache.slot_loader import LoadFromStore, Resident
from services.worker.adapter_cache.slot_tier import SlotTier
from services.worker.adapter_cache.stats import CacheStats

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
    "Resident",
    "SlotTier",
    "make_policy",
]
