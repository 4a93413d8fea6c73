"""/readyz's verdict: the scheduler and a worker always; the registry only until the catalog mirror is loaded."""

from services.gateway.readiness import ClusterView
from shared.schemas import ServiceHeartbeat, WorkerHeartbeat, WorkerPhase


def view(*services: str, worker: bool = True) -> ClusterView:
    cluster = ClusterView(60)
    for name in services:
        cluster.on_service(ServiceHeartbeat(service=name, instance_id=f"{name}-1", ready=True))
    if worker:
        cluster.on_worker(
            WorkerHeartbeat(
                worker_id="w1",
                base_model="m",
                ready=True,
                running=0,
                waiting=0,
                max_running=8,
                kv_blocks_free=1,
                kv_blocks_total=1,
            )
        )
    return cluster


def test_a_loaded_catalog_mirror_serves_without_the_registry():
    ready, components = view("scheduler").status(catalog_loaded=True)
    assert ready and components["registry"] == "missing" and components["catalog"] == "mirrored"


def test_before_the_mirror_is_loaded_the_registry_is_required():
    assert not view("scheduler").status(catalog_loaded=False)[0]
    ready, components = view("scheduler", "registry").status(catalog_loaded=False)
    assert ready and components["catalog"] == "loading"


def test_scheduler_and_a_worker_are_always_required():
    assert not view("registry").status(catalog_loaded=True)[0]
    ready, components = view("scheduler", "registry", worker=False).status(catalog_loaded=True)
    assert not ready and components["workers"] == "missing"


def test_readyz_says_which_safety_checks_a_deployment_turned_off():
    cluster = view("scheduler", "registry")
    assert cluster.status(catalog_loaded=True)[1]["safety_checks"] == "on"
    for instance in ("registry-1", "registry-2"):  # two replicas, one line
        beat = ServiceHeartbeat(
            service="registry", instance_id=instance, ready=True, checks_off=["release_require_eval"]
        )
        cluster.on_service(beat)
    ready, components = cluster.status(catalog_loaded=True)
    assert ready and components["safety_checks"] == "off: registry release_require_eval"
    assert cluster.checks_off() == ["registry release_require_eval"]  # the dashboard's line


def worker_phase(worker_id: str, phase: WorkerPhase, detail: str) -> ServiceHeartbeat:
    return ServiceHeartbeat(service="worker", instance_id=worker_id, ready=phase == "ready", detail=detail, phase=phase)


def test_a_starting_worker_shows_its_phase_not_just_missing():
    cluster = view("scheduler", "registry", worker=False)
    cluster.on_service(worker_phase("w2", "building_kernels", "building_kernels (the native CPU kernels) for 40 s"))
    ready, components = cluster.status(catalog_loaded=True)
    assert not ready
    assert components["workers"] == "not ready: w2 building_kernels (the native CPU kernels) for 40 s"


def test_ready_workers_are_counted_beside_the_ones_still_starting():
    cluster = view("scheduler", "registry")  # w1 ready
    cluster.on_service(worker_phase("w1", "ready", ""))
    cluster.on_service(worker_phase("w2", "loading_model", "loading_model (m) for 3 s"))
    ready, components = cluster.status(catalog_loaded=True)
    assert ready and components["workers"] == "1 ready; not ready: w2 loading_model (m) for 3 s"
