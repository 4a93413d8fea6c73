"""One OpenMP team per process: torch's intra-op parallelism (and the native kernels', which share its
GNU OpenMP runtime) on the engine's step thread only.

GNU OpenMP keeps a pool of worker threads for every thread that has started a parallel region, alive
after it, and counts them all (the first thread counts from the start). Once a process holds more of
them than it has CPUs, every team's workers stop spinning between regions after about a hundred turns
and sleep on a futex, so each of a decode step's ~150 parallel regions pays a wake-up. On a 2-core box
one pool on the step thread besides the main thread is at the limit; a second pool (the model loaded on
one thread, the engine built on another) is past it. Measured on the shared 2-core box, 150 of SmolLM2's
bf16 projections at one row: 12-15 ms on the thread that owned the only pool, 22-33 ms on a second
thread while the first one's pool lived, 14 ms once it was released; a whole bf16 decode step in the
worker (the stack's TPOT) 29-32 ms before, 19.5-21 ms after (the engine alone there: 16-17 ms).

So the worker sets torch's process-wide count to one (:func:`serial_process`: every thread runs torch
inline, a parallel_for with one thread starts no pool, and a pool the caller held is freed) and gives
its step thread, where it loads the model, builds the engine and runs the steps, the machine's count
(:func:`parallel_thread`): whatever other threads the process has (the event loop, executors, adapter
loads), its one OpenMP team is the step thread's. Where torch's runtime is not GNU OpenMP (no
``libgomp`` in the process) the step thread sets torch's process-wide count instead.
"""

import ctypes
import functools
from pathlib import Path

import structlog
import torch

from kernels import native

log = structlog.get_logger("kernels")
_parallel: int | None = None  # torch's count before serial_process first set it to 1


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """Torch's GNU OpenMP runtime as this process loaded it, or None. Not merely any ``libgomp`` mapped:
    wheels bundle their own (sentencepiece's ``libgomp-<hash>.so``), whose counts are not torch's."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    mapped = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    torch_lib = Path(torch.__file__).parent / "lib"
    ours = sorted(p for p in mapped if Path(p).parent == torch_lib) or sorted(
        p for p in mapped if Path(p).name == "libgomp.so.1"
    )
    if not ours:
        return None
    try:
        return ctypes.CDLL(ours[0])
    except OSError as e:
        log.warning("libgomp_unavailable", path=ours[0], error=str(e))
        return None


def serial_process() -> int:
    """Set torch's process-wide intra-op count to 1: this thread, and every thread that runs torch for
    the first time from now on, runs its ops inline and starts no OpenMP pool. Returns the count torch
    had before the first call (its default: the machine's physical cores), for :func:`parallel_thread`."""
    global _parallel
    if _parallel is None:
        _parallel = torch.get_num_threads()
    torch.set_num_threads(1)
    gomp = _libgomp()
    if gomp is not None:  # a pool this thread started before: freed (GNU OpenMP frees the caller's)
        gomp.omp_pause_resource_all(2)  # omp_pause_hard
    return _parallel


def parallel_thread(threads: int, native_kernels: bool = True) -> bool:
    """Give the calling thread ``threads`` intra-op threads whatever the process-wide count: its own
    OpenMP count, set after torch's lazy per-thread initialisation (which sets it to the process-wide
    count), in torch and, with ``native_kernels`` (the CPU engine: found or built here first), in the
    native kernels' library (csrc/threads.cpp: each library that calls at::parallel_for initialises a
    thread on its own). Where there is no GNU OpenMP runtime, torch's process-wide count instead (False)."""
    torch.get_num_threads()  # torch's per-thread initialisation first
    gomp = _libgomp()
    if gomp is None:
        torch.set_num_threads(threads)
        return False
    gomp.omp_set_num_threads(threads)
    if native_kernels and native.built():  # its own per-thread initialisation, then the count again
        torch.ops.lorafleet.set_intraop_threads(threads)
    return True
