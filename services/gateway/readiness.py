"""The gateway's view of the cluster, from service and worker heartbeats."""

from dataclasses import dataclass, field

from shared.liveness import Liveness
from shared.schemas import ServiceHeartbeat, WorkerHeartbeat

REQUIRED = ("scheduler",)
# the registry answers refusals, new models and the admin API; a gateway whose catalog mirror is
# loaded serves every known model without it, so it is required only until then
OPTIONAL = ("registry", "auditor")


@dataclass(slots=True)
class ClusterView:
    timeout_s: float
    services: dict[str, Liveness[ServiceHeartbeat]] = field(default_factory=dict)
    workers: Liveness[WorkerHeartbeat] = field(init=False)

    def __post_init__(self) -> None:
        self.workers = Liveness(self.timeout_s)
        for name in REQUIRED + OPTIONAL:
            self.services[name] = Liveness(self.timeout_s)

    def on_service(self, beat: ServiceHeartbeat) -> None:
        if beat.service in self.services:
            self.services[beat.service].seen(beat.instance_id, beat)

    def on_worker(self, beat: WorkerHeartbeat) -> None:
        self.workers.seen(beat.worker_id, beat)

    def unavailable(self) -> str | None:
        """Why a request cannot be served right now (a missing piece of its path), or None."""
        if not any(b.ready for b in self.services["scheduler"].alive().values()):
            return "scheduler"
        if not self.ready_workers():
            return "worker"
        return None

    def ready_workers(self) -> list[WorkerHeartbeat]:
        return [b for b in self.workers.alive().values() if b.ready]

    def status(self, catalog_loaded: bool = False) -> tuple[bool, dict[str, str]]:
        """(ready, component -> "ok" | "missing" | "not ready: ...") for /readyz."""
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
        components["workers"] = f"{len(workers)} ready" if workers else "missing"
        components["catalog"] = "mirrored" if catalog_loaded else "loading"
        ready = (
            all(components[name] == "ok" for name in REQUIRED)
            and bool(workers)
            and (catalog_loaded or components["registry"] == "ok")
        )
        return ready, components
