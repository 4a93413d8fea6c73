"""shared.heap.trim gives freed heap memory back: the resident size drops once it runs."""

from pathlib import Path

from shared import heap


def _rss_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_freed_heap_memory_leaves_the_resident_size_once_trimmed():
    chunks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MB of heap (each below malloc's mmap threshold)
    pinned = chunks[-1]  # the heap's top stays in use: free() alone cannot shrink it
    del chunks
    before = _rss_mb()
    assert heap.trim()
    assert _rss_mb() < before - 100, "the freed chunks stayed resident"
    assert len(pinned) == 64 * 1024
