"""What the cache tiers drive: the engine's slots (built-in AdapterManager, or vLLM's LoRA slots) and the
verified adapters they copy in. The tiers read only a cached adapter's rank, size and digest."""

from typing import Any, Protocol

from services.worker.lora.manager import PoolStats


class Cached(Protocol):
    """A verified adapter as the CPU tier holds it: AdapterWeights (built-in) or VerifiedFiles (vLLM)."""

    @property
    def rank(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def digest(self) -> str | None: ...


class SlotBackend(Protocol):
    """The engine side of the slot tier. ``load_adapter`` runs on a loader thread and may block; ``unload``
    runs under the hierarchy's lock, on any thread, and must not wait for the engine."""

    def stats(self) -> PoolStats: ...

    def slot_of(self, adapter: str) -> int | None: ...

    def load_adapter(self, name: str, source: Any, /) -> int: ...

    def unload(self, name: str) -> None: ...
