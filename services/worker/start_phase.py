"""What a worker is doing on its way to serving: one ``worker_phase`` log line as each phase begins,
and the phase its service heartbeat carries (the gateway's /readyz and the healthcheck show it)."""

import time

import structlog

from shared.schemas import WorkerPhase

log = structlog.get_logger("worker")


class StartPhase:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.phase: WorkerPhase = "loading_model"
        self.detail = ""
        self.since = time.monotonic()

    def enter(self, phase: WorkerPhase, detail: str = "") -> None:
        now = time.monotonic()
        log.info(
            "worker_phase",
            phase=phase,
            worker_id=self.worker_id,
            previous=self.phase,
            previous_s=round(now - self.since, 1),
            **({"detail": detail} if detail else {}),
        )
        self.phase, self.detail, self.since = phase, detail, now

    def current(self) -> WorkerPhase:
        return self.phase

    def status(self) -> tuple[bool, str]:
        """(ready, detail) for the service heartbeat: the phase, what it does and for how long."""
        if self.phase == "ready":
            return True, ""
        what = f"{self.phase} ({self.detail})" if self.detail else self.phase
        return False, f"{what} for {time.monotonic() - self.since:.0f} s"
