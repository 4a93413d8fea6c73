"""kernels/omp_threads.py: after serial_process every thread runs torch inline (no OpenMP pool), a pool
the caller held is freed, and parallel_thread gives one thread its own count, in torch's ops and in the
native kernels' (whose library initialises a thread on its own). Each case runs in a child Python
process: the counts are process-wide state."""

import textwrap

from tests.helpers.native import child_report, needs_toolchain

pytestmark = needs_toolchain

CHILD = textwrap.dedent(
    """
    import contextlib, json, os, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    with contextlib.suppress(ImportError):  # a wheel with its own libgomp, mapped before torch's is looked up
        import sentencepiece
    import torch

    def tasks():  # the process's live threads; a thread that has just been joined may still be listed
        return {int(t) for t in os.listdir("/proc/self/task")}

    base = tasks()  # before any parallel region: the kernels' probes below may run the first one
    from kernels import native, omp_threads, projections

    def gone(tids):  # a released pool's threads exit after the call returns: polled, bounded
        deadline = time.monotonic() + 10
        while tids & tasks() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not tids & tasks()

    assert native.built() and projections.native_small_linear()
    big = torch.randn(4096, 4096)
    big.sum()  # a parallel region on this thread (if the probes ran none): its pool's workers join the process
    pool_threads = tasks() - base
    threads = omp_threads.serial_process()
    released = gone(pool_threads)
    big.sum()  # inline now: no pool again
    after_inline = len(tasks() - base)

    def other():  # a thread of no StepThread: torch and the native kernels inline
        weight, x = torch.randn(4096, 512), torch.randn(1, 512)
        before = tasks()
        projections.small_linear(x, weight)
        big.sum()
        return torch.get_num_threads(), len(tasks() - before)

    with ThreadPoolExecutor(1) as pool:
        serial_count, serial_added = pool.submit(other).result()

    def step():
        weight, x = torch.randn(4096, 512), torch.randn(1, 512)
        projections.small_linear(x, weight)  # the native library's first parallel loop on this thread
        big.sum()
        return torch.get_num_threads()

    with ThreadPoolExecutor(1, initializer=omp_threads.parallel_thread, initargs=(threads,)) as pool:
        before = tasks()
        step_count = pool.submit(step).result()
        step_added = len(tasks() - before)  # alive and new: the step thread and its team's workers
    runtime = Path(omp_threads._libgomp()._name)
    print(json.dumps(dict(
        torch_runtime=runtime.parent == Path(torch.__file__).parent / "lib", threads=threads, main=torch.get_num_threads(), pool=len(pool_threads), released=released,
        after_inline=after_inline, serial_count=serial_count, serial_added=serial_added,
        step_count=step_count, step_added=step_added,
    )))
    """
)


def test_one_team_per_process() -> None:
    got = child_report(CHILD)
    assert got["torch_runtime"]  # torch's own libgomp, not another wheel's copy
    assert got["threads"] == 2 and got["main"] == 1
    assert got["pool"] == 1  # the main thread's team of two: one worker thread
    assert got["released"] and got["after_inline"] == 0  # freed, and not started again
    assert got["serial_count"] == 1 and got["serial_added"] == 0
    # the step thread itself and its team's one worker, its count kept past the native library's own
    # per-thread initialisation
    assert got["step_count"] == 2 and got["step_added"] == 2
