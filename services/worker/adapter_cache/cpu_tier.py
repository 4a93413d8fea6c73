"""The CPU tier: verified adapter weights in host memory under a byte budget, ready to copy into a slot."""

from services.worker.adapter_cache.backend import Cached
from services.worker.adapter_cache.policy import Entry, EvictionPolicy


class CpuTier:
    """Key -> a verified adapter (weights in slot layout, or vLLM's files), evicting by its own policy to stay within budget_bytes.

    Inclusive of the GPU tier: an adapter copied into a slot keeps its CPU copy until this tier's
    policy drops it. Not thread-safe: the hierarchy serialises access.
    """

    __slots__ = ("_items", "_nbytes", "budget_bytes", "policy")

    def __init__(self, budget_bytes: int, policy: EvictionPolicy):
        self.budget_bytes = budget_bytes
        self.policy = policy
        self._items: dict[str, tuple[Entry, Cached]] = {}
        self._nbytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def keys(self) -> list[str]:
        return list(self._items)

    def get(self, key: str) -> Cached | None:
        item = self._items.get(key)
        return None if item is None else item[1]

    def put(self, entry: Entry, weights: Cached, now: float) -> list[str]:
        """Keep ``weights`` (evicting the policy's victims until they fit); the keys evicted.

        Weights larger than the whole budget are not kept, and nothing is evicted for them.
        """
        size = weights.nbytes
        if entry.key in self._items or size > self.budget_bytes:
            return []
        evicted: list[str] = []
        while self._nbytes + size > self.budget_bytes:
            victim = self.policy.victim((e for e, _ in self._items.values()), now)
            assert victim is not None, "a non-empty tier over budget has a victim"
            self.remove(victim.key)
            evicted.append(victim.key)
        self._items[entry.key] = (entry, weights)
        self._nbytes += size
        return evicted

    def remove(self, key: str) -> bool:
        item = self._items.pop(key, None)
        if item is None:
            return False
        self._nbytes -= item[1].nbytes
        return True
