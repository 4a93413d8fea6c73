"""``Stack.kill``: SIGKILL as a crash would, and a bounded wait for the process to go, so a test killing a
service mid-run fails with the process named rather than hanging on a process the kernel has not let go."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorafleet.cli.stack import Stack


def test_a_killed_process_is_gone_and_forgotten(tmp_path: Path) -> None:
    stack = Stack({}, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
    )
    stack.procs["svc"] = proc
    started = time.monotonic()
    stack.kill("svc")
    assert proc.returncode == -9 and time.monotonic() - started < 10
    assert "svc" not in stack.procs


class Unkillable:
    """A process the kernel keeps after SIGKILL (uninterruptible sleep): what ``Popen`` reports of one."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = False

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired("svc", timeout or 0)


def test_a_process_still_there_after_sigkill_is_an_error_naming_it(tmp_path: Path) -> None:
    stack = Stack({}, tmp_path)
    stuck = Unkillable()
    stack.procs["reg-1"] = stuck  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match=r"reg-1 \(pid 4242\) still runs 0.5 s after SIGKILL"):
        stack.kill("reg-1", timeout_s=0.5)
    assert stuck.killed
