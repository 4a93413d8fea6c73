"""Asyncio front of the engine: one background thread runs the step loop, outputs stream per request.

On CPU that thread should also be the one that loaded the model and built the engine (``StepThread``):
GNU OpenMP keeps a pool of worker threads for every thread that has run a parallel region, and once a
process holds more pool threads than CPUs every team sleeps between regions instead of spinning
(kernels/omp_threads.py), which doubled a batch-1 bf16 decode step on the 2-core box (about 27 against
13 ms: the model loaded and the engine built on other threads than the steps).
"""

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

import structlog
import torch

from kernels import omp_threads
from services.worker.engine.engine import LLMEngine
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.errors import DuplicateRequest
from services.worker.engine.lora_hook import LoraProvider
from services.worker.engine.model_loader import LoadedModel
from services.worker.engine.sequence import EngineRequest, RequestOutput
from shared.config import GrammarBounds

_IDLE_POLL_S = 0.005
_T = TypeVar("_T")
log = structlog.get_logger("engine")
# one request's outputs, handed from the step thread to the caller's event loop; an exception ends it
_Outputs = asyncio.Queue[RequestOutput | BaseException]


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = 0  # of which found there (not recomputed)


class EngineDead(RuntimeError):
    """The step loop failed; every in-flight request ends with this error."""


class StepThread:
    """The thread a worker loads its model on, builds its engine on and then runs the step loop on
    (``AsyncEngine.start(thread)``), with ``threads`` intra-op threads where the process runs torch
    inline elsewhere (kernels/omp_threads.py), reniced from its start (``lower_priority``) so that the
    OpenMP threads it starts inherit the value: the process's one OpenMP team."""

    def __init__(self, config: EngineConfig, threads: int):
        self._executor = ThreadPoolExecutor(1, "engine-step-loop", initializer=self._setup, initargs=(config, threads))

    @staticmethod
    def _setup(config: EngineConfig, threads: int) -> None:
        lower_priority(config)
        omp_threads.parallel_thread(config.num_threads or threads, torch.device(config.device).type == "cpu")

    def submit(self, fn: Callable[[], _T]) -> Future[_T]:
        return self._executor.submit(fn)

    async def run(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` on the thread, awaited."""
        return await asyncio.wrap_future(self.submit(fn))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class AsyncEngine:
    """Thread-safe owner of an LLMEngine. Create with ``from_loaded``, call ``start`` once, ``shutdown`` at exit."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._adds: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, _Outputs]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._on: Future[None] | None = None  # the step loop on a StepThread
        self.step_thread_id: int | None = None  # the step loop's OS thread id, once it runs
        self._stats = EngineStats(0, 0, engine.blocks.allocator.num_free, engine.num_blocks)

    @classmethod
    def from_loaded(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        adapter_manager: LoraProvider | None = None,
        grammar_bounds: GrammarBounds | None = None,
    ) -> "AsyncEngine":
        return cls(LLMEngine.from_loaded(loaded, config, adapter_manager, grammar_bounds))

    def start(self, thread: StepThread | None = None) -> None:
        """Run the step loop on ``thread`` (the one the engine was built on), else on a thread of its own."""
        if thread is not None:
            self._on = thread.submit(self._loop)
        else:
            self._thread.start()

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._on is not None:
            self._on.result()
        else:
            self._thread.join()
        self.engine.grammars.close()

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's per-step outputs; the last has ``finished`` set.

        Raises RequestTooLarge, InvalidSchema, GrammarTooComplex, GrammarCompilesBusy (or DuplicateRequest)
        before the first output. Leaving the iterator early, or cancelling the task consuming it, aborts the
        request.
        """
        structured = request.sampling.structured
        if structured is not None:  # compiled off the step loop, bounded; the request carries it there
            request = replace(request, grammar=await self.engine.grammars.prepare(structured, request.tenant or ""))
        queue: _Outputs = asyncio.Queue()
        with self._wake:
            if self._stopping:
                raise EngineDead("the engine is shut down")
            if request.request_id in self._streams:
                raise DuplicateRequest(f"request {request.request_id!r} is already streaming")
            self._streams[request.request_id] = (asyncio.get_running_loop(), queue)
            self._adds.append(request)
            self._wake.notify()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.cancel(request.request_id)

    def cancel(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the next step and its stream ends with "abort"."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def _loop(self) -> None:
        self.step_thread_id = threading.get_native_id()
        lower_priority(self.engine.config)
        while True:
            with self._wake:
                while not (self._stopping or self._adds or self._aborts or self.engine.has_unfinished()):
                    self._wake.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            for request in adds:
                try:
                    self.engine.add_request(request)
                except Exception as error:
                    self._deliver(request.request_id, error)
            for request_id in aborts:
                output = self.engine.abort(request_id)
                if output is not None:
                    self._deliver(request_id, output)
            try:
                outputs = self.engine.step()
            except Exception as error:
                self._fail_all(error)
                return
            for output in outputs:
                self._deliver(output.request_id, output)
            self._refresh_stats()
            if not outputs:
                # Everything left waits (e.g. for an adapter to become resident): poll, don't spin.
                with self._wake:
                    if not (self._stopping or self._adds or self._aborts):
                        self._wake.wait(timeout=_IDLE_POLL_S)
        self._fail_all(EngineDead("the engine is shut down"))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        final = isinstance(item, BaseException) or item.finished
        with self._lock:
            target = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if target is not None:
            _hand_off(*target, item)

    def _refresh_stats(self) -> None:
        scheduler = self.engine.scheduler
        self._stats = EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            kv_blocks_free=self.engine.blocks.allocator.num_free,
            kv_blocks_total=self.engine.num_blocks,
            prefix_queried_tokens=self.engine.blocks.queried_tokens,
            prefix_hit_tokens=self.engine.blocks.hit_tokens,
        )

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            self._stopping = True
            streams, self._streams = self._streams, {}
        for request_id, (loop, queue) in streams.items():
            self.engine.abort(request_id)
            failure = error if isinstance(error, EngineDead) else EngineDead(f"engine step failed: {error!r}")
            _hand_off(loop, queue, failure)


def lower_priority(config: EngineConfig) -> None:
    """Renice the calling thread (before it runs any torch op, so the OpenMP threads it starts
    inherit the value): on CPU the step loop's threads then give way to the processes' I/O."""
    if config.compute_nice <= 0 or torch.device(config.device).type != "cpu" or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), config.compute_nice))
    except OSError as e:  # e.g. a sandbox without the permission: run at normal priority
        log.warning("compute_nice_unavailable", error=str(e))


def _hand_off(loop: asyncio.AbstractEventLoop, queue: _Outputs, item: RequestOutput | BaseException) -> None:
    # RuntimeError: the consumer's event loop is closed, nobody is listening any more
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(queue.put_nowait, item)
