"""RSS and open-file counts of running processes, read from /proc, sampled on a fixed period."""

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Sample:
    t_s: float  # seconds since sampling started
    rss_mb: float
    open_files: int


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ProcessLookupError(pid)  # a zombie has no VmRSS


def open_files(pid: int) -> int:
    """Open file descriptors: files, sockets, pipes, eventfds alike."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def sample(pid: int, t_s: float) -> Sample | None:
    """The process's figures now, or None once it has exited."""
    try:
        return Sample(t_s, rss_mb(pid), open_files(pid))
    except (FileNotFoundError, ProcessLookupError):
        return None


async def sample_every(
    pids: dict[str, int],
    interval_s: float,
    stop: asyncio.Event,
    into: dict[str, list[Sample]],
    on_sample: Callable[[float], None] | None = None,
) -> None:
    """Append one sample per live process to ``into[name]`` every ``interval_s`` until ``stop`` is set."""
    started = time.monotonic()
    while True:
        t_s = time.monotonic() - started
        for name, pid in pids.items():
            taken = sample(pid, t_s)
            if taken is not None:
                into.setdefault(name, []).append(taken)
        if on_sample is not None:
            on_sample(t_s)
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except TimeoutError:
            pass
