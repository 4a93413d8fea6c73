"""The gateway's view of the cluster, from service and worker heartbeats."""

from dataclasses import dataclass, field

from shared.liveness import Liveness
from shared.schemas import ServiceHeartbeat, SupervisorStatus, WorkerHeartbeat

REQUIRED = ("scheduler",)
# the registry answers refusals, new models and the admin API; a gateway whose catalog mirror is
# loaded serves every known model without it, so it is required only until then
OPTIONAL = ("registry", "auditor")


@dataclass(slots=True)
class ClusterView:
    timeout_s: float
    services: dict[str, Liveness[ServiceHeartbeat]] = field(default_factory=dict)
    workers: Liveness[WorkerHeartbeat] = field(init=False)
    worker_phases: Liveness[ServiceHeartbeat] = field(init=False)  # workers' service heartbeats: their phase
    supervisors: Liveness[SupervisorStatus] = field(init=False)  # lorafleet up's, by host

    def __post_init__(self) -> None:
        self.workers = Liveness(self.timeout_s)
        self.worker_phases = Liveness(self.timeout_s)
        self.supervisors = Liveness(self.timeout_s)
        for name in REQUIRED + OPTIONAL:
            self.services[name] = Liveness(self.timeout_s)

    def on_service(self, beat: ServiceHeartbeat) -> None:
        if beat.service in self.services:
            self.services[beat.service].seen(beat.instance_id, beat)
        elif beat.service == "worker":
            self.worker_phases.seen(beat.instance_id, beat)

    def on_worker(self, beat: WorkerHeartbeat) -> None:
        self.workers.seen(beat.worker_id, beat)

    def on_supervisor(self, status: SupervisorStatus) -> None:
        self.supervisors.seen(status.host, status)

    def supervised(self) -> dict[str, str]:
        """Process -> "restarting: ..." / "failed: ..." for those a live supervisor does not have running."""
        out: dict[str, str] = {}
        for status in self.supervisors.alive().values():
            for p in status.processes:
                if p.state != "running":
                    out[p.name] = f"{p.state}: {p.detail.splitlines()[0] if p.detail else ''}".rstrip(": ")
        return out

    def checks_off(self) -> list[str]:
        """``<service> <check>`` for each safety check a live instance runs without, once each."""
        return sorted(
            {
                f"{name} {check}"
                for name, live in self.services.items()
                for b in live.alive().values()
                for check in b.checks_off
            }
        )

    def unavailable(self) -> str | None:
        """Why a request cannot be served right now (a missing piece of its path), or None."""
        if not any(b.ready for b in self.services["scheduler"].alive().values()):
            return "scheduler"
        if not self.ready_workers():
            return "worker"
        return None

    def ready_workers(self) -> list[WorkerHeartbeat]:
        return [b for b in self.workers.alive().values() if b.ready]

    def unready_workers(self) -> str:
        """Live workers that are not ready, each with its phase: ``w1 building_kernels (...) for 40 s``."""
        ready = {b.worker_id for b in self.ready_workers()}
        return ", ".join(
            f"{worker_id} {beat.detail or beat.phase}"
            for worker_id, beat in sorted(self.worker_phases.alive().items())
            if not beat.ready and worker_id not in ready
        )

    def status(self, catalog_loaded: bool = False) -> tuple[bool, dict[str, str]]:
        """(ready, component -> "ok" | "missing" | "not ready: ...") for /readyz; ``workers`` is "N ready",
        then the workers that are not ready with their phase (``not ready: w1 building_kernels ...``)."""
        components: dict[str, str] = {}
        for name, live in self.services.items():
            beats = list(live.alive().values())
            if any(b.ready for b in beats):
                components[name] = "ok"
            elif beats:
                components[name] = f"not ready: {beats[0].detail}"
            else:
                components[name] = "missing"
        workers = self.ready_workers()
        parts = [f"{len(workers)} ready"] if workers else []
        if waiting := self.unready_workers():
            parts.append(f"not ready: {waiting}")
        components["workers"] = "; ".join(parts) or "missing"
        supervised = self.supervised()
        for name, state in supervised.items():  # a missing component the supervisor is bringing back
            component = "workers" if name == "worker" else name
            if components.get(component, "missing") == "missing":
                components[component] = state
        if self.supervisors.alive():
            components["supervisor"] = "; ".join(f"{n} {s}" for n, s in sorted(supervised.items())) or "ok"
        components["catalog"] = "mirrored" if catalog_loaded else "loading"
        off = self.checks_off()
        components["safety_checks"] = f"off: {', '.join(off)}" if off else "on"
        ready = (
            all(components[name] == "ok" for name in REQUIRED)
            and bool(workers)
            and (catalog_loaded or components["registry"] == "ok")
        )
        return ready, components
