"""The CPU tier: verified adapter weights in host memory under a byte budget, ready to copy into a slot."""

from collections import Counter

from services.worker.adapter_cache.backend import Cached
from services.worker.adapter_cache.policy import Entry, EvictionPolicy


class CpuTier:
    """Key -> a verified adapter (weights in slot layout, or vLLM's files), evicting by its own policy to stay within budget_bytes.

    Inclusive of the GPU tier: an adapter copied into a slot keeps its CPU copy until this tier's
    policy drops it. Each copy counts toward the tenant whose request loaded it. A tenant may hold at
    most ``tenant_share`` of the budget once the tier is full and another tenant's adapter needs room:
    an insert that must evict takes its own tenant's coldest first while that tenant is over its share,
    else the coldest of a tenant over its share, and only then the policy's coldest of all. Not
    thread-safe: the hierarchy serialises access.
    """

    __slots__ = ("_items", "_nbytes", "_tenant_bytes", "budget_bytes", "policy", "tenant_share")

    def __init__(self, budget_bytes: int, policy: EvictionPolicy, tenant_share: float = 1.0):
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.tenant_share = tenant_share
        self._items: dict[str, tuple[Entry, Cached]] = {}
        self._nbytes = 0
        self._tenant_bytes: Counter[str | None] = Counter()

    def __contains__(self, key: str) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def share_bytes(self) -> int:
        """Bytes one tenant may hold when the tier is contended."""
        return int(self.tenant_share * self.budget_bytes)

    def tenant_bytes(self, tenant: str | None) -> int:
        return self._tenant_bytes[tenant]

    def keys(self) -> list[str]:
        return list(self._items)

    def get(self, key: str) -> Cached | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def put(self, entry: Entry, weights: Cached, now: float) -> list[str]:
        """Keep ``weights`` (evicting victims until they fit); the keys evicted.

        Weights larger than the whole budget are not kept, nor, when room must be made, weights larger
        than their tenant's share; nothing is evicted for them.
        """
        size = weights.nbytes
        if entry.key in self._items or size > self.budget_bytes:
            return []
        if self._nbytes + size > self.budget_bytes and entry.tenant is not None and size > self.share_bytes:
            return []
        evicted: list[str] = []
        while self._nbytes + size > self.budget_bytes:
            victim = self._victim(entry, size, now)
            assert victim is not None, "a non-empty tier over budget has a victim"
            self.remove(victim.key)
            evicted.append(victim.key)
        self._items[entry.key] = (entry, weights)
        self._nbytes += size
        self._tenant_bytes[entry.tenant] += size
        return evicted

    def remove(self, key: str) -> bool:
        item = self._items.pop(key, None)
        if item is None:
            return False
        self._nbytes -= item[1].nbytes
        self._tenant_bytes[item[0].tenant] -= item[1].nbytes
        if not self._tenant_bytes[item[0].tenant]:
            del self._tenant_bytes[item[0].tenant]
        return True

    def _over_share(self, tenant: str | None, extra: int = 0) -> bool:
        return tenant is not None and self._tenant_bytes[tenant] + extra > self.share_bytes

    def _victim(self, incoming: Entry, size: int, now: float) -> Entry | None:
        entries = [e for e, _ in self._items.values()]
        if self._over_share(incoming.tenant, size):
            return self.policy.victim((e for e in entries if e.tenant == incoming.tenant), now)
        over = [e for e in entries if self._over_share(e.tenant)]
        return self.policy.victim(over or entries, now)
