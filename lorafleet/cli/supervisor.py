"""Keep every process ``lorafleet up`` started running, as compose's restart policies do for containers.

A process that exits is started again after a backoff that doubles with each crash in a row (1 s,
2 s, 4 s, ... up to ``max_backoff_s``) and starts over once a run has lasted ``stable_s``. One that
crashes ``give_up_after`` times within ``window_s`` is left stopped and reported with the last lines of
its log, instead of looping silently. Every change is printed, written to ``supervisor.log`` beside
the services' logs, and published on ``lf.supervisor.status`` so that the gateway's ``/readyz`` shows
``restarting`` (or ``failed``) for it."""

import asyncio
import contextlib
import json
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from shared import subjects
from shared.bus import connect, encode
from shared.schemas import SupervisedProcess, SupervisorStatus

State = Literal["running", "restarting", "failed"]
TAIL_LINES = 12


def tail(path: Path | None, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' when there is none)."""
    if path is None or not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass(slots=True, eq=False)
class Child:
    """One supervised process: how to find its current process and how to start it again."""

    name: str
    proc: Callable[[], subprocess.Popen]  # the process running now (it changes with each restart)
    restart: Callable[[], object]  # starts it again (raises if it cannot)
    log_file: Path | None = None
    state: State = "running"
    started_at: float = field(default_factory=time.monotonic)
    crashes: deque[float] = field(default_factory=deque)  # when it exited, within the window
    in_a_row: int = 0
    restarts: int = 0
    due: float | None = None  # when the next start is due
    detail: str = ""


@dataclass
class Supervisor:
    children: list[Child]
    say: Callable[[str], None] = print
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    give_up_after: int = 5
    window_s: float = 300.0
    clock: Callable[[], float] = time.monotonic

    def poll(self) -> bool:
        """One pass: notice exits, start what is due; True when any state changed."""
        now = self.clock()
        changed = False
        for child in self.children:
            if child.state == "running":
                code = child.proc().poll()
                if code is None:
                    if now - child.started_at >= self.stable_s:
                        child.in_a_row = 0
                    continue
                changed = True
                self._exited(child, code, now)
            elif child.state == "restarting" and child.due is not None and now >= child.due:
                changed = True
                self._start(child, now)
        return changed

    def _exited(self, child: Child, code: int, now: float) -> None:
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self.window_s:
            child.crashes.popleft()
        if len(child.crashes) >= self.give_up_after:
            child.state, child.due = "failed", None
            child.detail = (
                f"exited {len(child.crashes)} times within {self.window_s:.0f}s (last: code {code}); not restarted. "
                f"Last log lines:\n{tail(child.log_file)}"
            )
            self.say(f"{child.name} keeps crashing: {child.detail}")
            return
        delay = min(self.max_backoff_s, self.backoff_s * 2**child.in_a_row)
        child.in_a_row += 1
        child.state, child.due = "restarting", now + delay
        child.detail = f"exited with code {code}; restart {child.restarts + 1} in {delay:.0f}s"
        self.say(f"{child.name} {child.detail}")

    def _start(self, child: Child, now: float) -> None:
        try:
            child.restart()
        except Exception as e:  # it could not even start: counts as another crash
            self.say(f"{child.name} failed to start again: {e}")
            self._exited(child, -1, now)
            return
        child.restarts += 1
        child.state, child.due, child.started_at = "running", None, now
        child.detail = f"restarted ({child.restarts} so far)"
        self.say(f"{child.name} {child.detail}")

    def status(self) -> list[SupervisedProcess]:
        return [
            SupervisedProcess(name=c.name, state=c.state, restarts=c.restarts, detail=c.detail[-2000:])
            for c in self.children
        ]

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc().pid for c in self.children}


POLL_S = 0.5
PUBLISH_S = 2.0
CLOSE_S = 5.0


async def supervise(supervisor: Supervisor, nats_url: str, pids_file: Path) -> None:
    """Poll the children until cancelled; publish their states on ``lf.supervisor.status`` (every
    ``PUBLISH_S`` and at each change) and keep ``pids_file`` (name -> pid) current."""
    nc = await connect(nats_url, "lorafleet-supervisor")
    host = socket.gethostname()[:256] or "localhost"
    last = 0.0
    try:
        _write_pids(pids_file, supervisor)
        while True:
            changed = supervisor.poll()
            if changed:
                _write_pids(pids_file, supervisor)
            now = time.monotonic()
            if changed or now - last >= PUBLISH_S:
                last = now
                with contextlib.suppress(Exception):  # NATS itself may be the one restarting
                    await nc.publish(
                        subjects.SUPERVISOR_STATUS, encode(SupervisorStatus(host=host, processes=supervisor.status()))
                    )
            await asyncio.sleep(POLL_S)
    finally:
        # Bounded: right after NATS itself was restarted the client may still be reconnecting, and
        # `up` must go on to stop every process rather than wait on it.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), CLOSE_S)


def _write_pids(path: Path, supervisor: Supervisor) -> None:
    """A few bytes, rewritten at a change: not worth a thread."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(supervisor.pids()))
    tmp.replace(path)
