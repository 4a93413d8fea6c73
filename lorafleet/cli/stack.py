"""Run the five services as separate processes and wait until each reports ready."""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared import subjects
from shared.bus import connect, decode
from shared.schemas import ServiceHeartbeat

SERVICES = ("registry", "auditor", "scheduler", "worker", "gateway")


@dataclass(slots=True)
class Stack:
    """Service processes sharing one environment (NATS/Redis URLs, state paths)."""

    env: dict[str, str]
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(
        self, name: str, extra_env: dict[str, str] | None = None, key: str | None = None, python: str | None = None
    ) -> subprocess.Popen:
        """Start ``python -m services.<name>``; ``key`` names the process when one service runs twice,
        ``python`` another interpreter than this one (a vLLM worker runs on .venv-vllm's)."""
        key = key or name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, **(extra_env or {})}
        with open(self.log_dir / f"{key}.log", "ab") as log:  # the child holds its own copy of the descriptor
            proc = subprocess.Popen(
                [python or sys.executable, "-m", f"services.{name}"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[key] = proc
        return proc

    def stop(self, key: str, timeout_s: float = 10.0) -> None:
        proc = self.procs.pop(key, None)
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self, key: str, timeout_s: float = 30.0) -> None:
        """SIGKILL, as a crash would; RuntimeError if the process is still there after ``timeout_s``
        (stuck in the kernel), rather than a caller waiting on it for ever."""
        proc = self.procs.pop(key)
        proc.kill()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{key} (pid {proc.pid}) still runs {timeout_s} s after SIGKILL") from None

    def stop_all(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every service at once, then wait for all within one shared deadline."""
        procs, self.procs = self.procs, {}
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            with contextlib.suppress(ProcessLookupError):  # a child it left behind (vLLM's engine core)
                os.killpg(proc.pid, signal.SIGKILL)

    def dead(self) -> dict[str, int]:
        return {k: p.returncode for k, p in self.procs.items() if p.poll() is not None}


async def wait_ready(nats_url: str, stack: Stack, services: tuple[str, ...], timeout_s: float) -> None:
    """Return once every named service has published a ready heartbeat; raise if one dies or time runs out."""
    nc = await connect(nats_url, "lorafleet-launcher")
    ready: set[str] = set()
    doing: dict[str, str] = {}  # service -> what its last not-ready heartbeat said (a worker's phase)

    async def on_beat(msg) -> None:
        beat = decode(ServiceHeartbeat, msg.data)
        if beat.ready:
            ready.add(beat.service)
        elif beat.detail:
            doing[beat.service] = beat.detail

    await nc.subscribe(subjects.SERVICE_HEARTBEAT_ALL, cb=on_beat)
    deadline = time.monotonic() + timeout_s
    try:
        while not set(services) <= ready:
            if stack.dead():
                raise RuntimeError(f"service exited during start-up: {stack.dead()} (logs in {stack.log_dir})")
            if time.monotonic() > deadline:
                missing = [
                    f"{name} ({doing[name]})" if name in doing else name for name in sorted(set(services) - ready)
                ]
                raise TimeoutError(f"not ready after {timeout_s:.0f}s: {', '.join(missing)} (logs in {stack.log_dir})")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
