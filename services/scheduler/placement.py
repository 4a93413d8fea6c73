"""Choose a worker for a request from the latest heartbeats (NATS-free, unit-tested directly)."""

from shared.schemas import InferRequest, WorkerHeartbeat


def load_of(beat: WorkerHeartbeat) -> float:
    return (beat.running + beat.waiting) / beat.max_running


def rank_workers(request: InferRequest, workers: list[WorkerHeartbeat], exclude: set[str]) -> list[WorkerHeartbeat]:
    """Ready workers serving the request's base model, best first: adapter already resident,
    then lowest load, then most free KV."""
    adapter_key = request.adapter.adapter_id + f"@{request.adapter.version}" if request.adapter else None
    candidates = [w for w in workers if w.ready and w.worker_id not in exclude and w.base_model == request.base_model]

    def score(w: WorkerHeartbeat) -> tuple:
        resident = adapter_key is None or adapter_key in w.resident_adapters
        return (not resident, load_of(w), -w.kv_blocks_free, w.worker_id)

    return sorted(candidates, key=score)
