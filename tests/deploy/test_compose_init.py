"""`docker compose up` on a fresh checkout: everything a service mounts or reads is shipped in the repo
or written by the one-shot init service, which runs before any service that needs a credential and
whose own command (run here, in directories standing for its volumes) writes a config nats-server
accepts, the same on a second run."""

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nats as nats_client
import pytest
import yaml
from nats import errors as nats_errors
from redis import exceptions as redis_exceptions

from lorafleet.cli.compose_services import compose_worker_ids
from lorafleet.cli.infra import Server, free_port, nats_server_binary, redis_server_binary, start_nats, wait_port
from lorafleet.cli.nats_accounts import users_of
from lorafleet.cli.nats_auth import init_deploy
from shared.bus import connect
from shared.config import CommonSettings
from shared.redis_conn import connect_redis
from tests.deploy.compose_files import (
    INIT,
    REPO,
    env_files,
    in_volume,
    load,
    mount_source,
    run_init,
    secret_volumes,
    waits_for_init,
)

FRESH = {"single": ("compose.yaml",), "cluster": ("compose.cluster.yaml",)}
CREDENTIAL_FILES = ("LF_NATS_PASSWORD_FILE", "LF_REDIS_PASSWORD_FILE", "LF_METRICS_TOKEN_FILE")


def tracked(path: str) -> bool:
    done = subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=REPO, capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.fixture(params=sorted(FRESH), scope="module")
def fresh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, Path]]:
    """A compose project and its init service's volumes after one run of its command."""
    compose = load(*FRESH[request.param])
    dirs, done = run_init(compose, tmp_path_factory.mktemp(request.param))
    assert done.returncode == 0, done.stderr
    return compose, dirs


def test_every_bind_mount_and_env_file_is_shipped_or_optional(fresh: tuple[dict, dict[str, Path]]) -> None:
    compose, _ = fresh
    named = set(compose["volumes"])
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = mount_source(volume)
            if source.startswith("./"):
                assert (REPO / source).exists() and tracked(source.removeprefix("./")), (name, source)
            else:
                assert source in named, (name, source)
        for path, required in env_files(service):
            assert not required, (name, path)  # an operator's own file (API keys), never needed to start


def test_every_credential_a_service_reads_is_in_a_volume_the_init_service_fills(
    fresh: tuple[dict, dict[str, Path]],
) -> None:
    compose, dirs = fresh
    readers = 0
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        for key in CREDENTIAL_FILES:
            if key in env:
                file = in_volume(service, dirs, env[key])
                assert file is not None and file.is_file() and file.read_text().strip(), (name, key)
                readers += 1
        if "LF_NATS_USER" in env:
            assert "LF_NATS_PASSWORD_FILE" in env and "LF_NATS_PASSWORD" not in env, name
    assert readers >= 8
    nats = [s for s in compose["services"].values() if str(s.get("image", "")).startswith("nats:")]
    assert nats
    for service in nats:
        config = service["command"][service["command"].index("-c") + 1]
        assert in_volume(service, dirs, config) or any(v.endswith(f":{config}:ro") for v in service["volumes"])
    redis = compose["services"]["redis"]
    conf = in_volume(redis, dirs, redis["command"][1])
    assert conf is not None and conf.read_text().startswith("requirepass ")


def test_services_that_need_credentials_wait_for_the_init_service(fresh: tuple[dict, dict[str, Path]]) -> None:
    compose, _ = fresh
    filled = secret_volumes(compose)
    needing = [
        name
        for name, service in compose["services"].items()
        if name != INIT and any(mount_source(v) in filled for v in service.get("volumes", []))
    ]
    assert set(compose["services"]) - set(needing) <= {INIT, "lb", "prometheus", "grafana"}  # the rest need one
    for name in needing:
        assert waits_for_init(compose, name), name
    assert compose["services"][INIT]["restart"] == "no"


def test_passwords_agree_between_the_nats_config_and_each_service(fresh: tuple[dict, dict[str, Path]]) -> None:
    compose, dirs = fresh
    conf = json.loads((dirs["secrets-nats"] / "nats.conf").read_text())
    users = {name: u["password"] for name, u in users_of(conf).items()}
    redis = compose["services"]["redis"]
    redis_password = (dirs["secrets-redis"] / "password").read_text().strip()
    assert (dirs["secrets-redis"] / "redis.conf").read_text() == f"requirepass {redis_password}\n"
    seen: dict[str, str] = {}
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        if "LF_NATS_USER" not in env:
            continue
        file = in_volume(service, dirs, env["LF_NATS_PASSWORD_FILE"])
        assert file is not None
        password = file.read_text().strip()
        assert users[env["LF_NATS_USER"]] == password, name
        assert seen.setdefault(env["LF_NATS_USER"], password) == password  # replicas share their service's user
        if "LF_REDIS_PASSWORD_FILE" in env:
            redis_file = in_volume(service, dirs, env["LF_REDIS_PASSWORD_FILE"])
            assert redis_file is not None and redis_file.read_text().strip() == redis_password, name
            assert env["LF_REDIS_URL"] == "redis://redis:6379/0"
    assert len(set(seen.values())) == len(seen)  # no two users share a password
    for name in ("gateway", "registry", "auditor", "admin"):
        assert not (dirs[f"secrets-{name}"] / "redis-password").exists()  # Redis only for those that use it
    assert "secrets-state" not in {mount_source(v) for v in redis.get("volumes", [])}


def test_generated_nats_config_is_accepted_by_nats_server(fresh: tuple[dict, dict[str, Path]]) -> None:
    _, dirs = fresh
    done = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(dirs["secrets-nats"] / "nats.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_second_run_changes_nothing(fresh: tuple[dict, dict[str, Path]]) -> None:
    compose, dirs = fresh
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for d in dirs.values() for p in d.rglob("*")}
    assert all(p.stat().st_mode & 0o077 == 0 for p in before)
    _, done = run_init(compose, next(iter(dirs.values())).parent)
    assert done.returncode == 0, done.stderr
    assert "up to date" in done.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for d in dirs.values() for p in d.rglob("*")} == before


def test_a_missing_volume_is_refused_with_its_name(tmp_path: Path) -> None:
    compose = load("compose.yaml")
    dirs, done = run_init(compose, tmp_path, skip=("secrets-worker-cpu-2",))
    assert done.returncode != 0 and "no volume mounted for worker-cpu-2" in done.stderr
    assert not any(d.exists() and any(d.iterdir()) for d in dirs.values())  # nothing half-written


def test_secrets_from_nats_auth_init_are_imported(tmp_path: Path) -> None:
    """compose.secrets-dir.yaml: the init service takes the passwords `nats_auth init --dir deploy` wrote,
    keeps compose.yaml's own workers, and the generated worker services find their env files."""
    creds = init_deploy(tmp_path / "deploy", workers=compose_worker_ids(1, 0))
    compose = load("compose.yaml", "compose.secrets-dir.yaml")
    service = compose["services"][INIT]
    binds = [v for v in service["volumes"] if v.startswith("./")]
    assert binds == ["./deploy/secrets/nats-users.json:/import/nats-users.json:ro"]
    imported = tmp_path / "deploy" / "secrets" / "nats-users.json"
    assert imported.exists()  # what the override mounts is what init writes
    command = list(service["command"])
    command[command.index("--import") + 1] = str(imported)
    compose["services"][INIT]["command"] = command
    dirs, done = run_init(compose, tmp_path / "volumes")
    assert done.returncode == 0, done.stderr
    assert (dirs["secrets-gateway"] / "nats-password").read_text().strip() == creds.users["gateway"]
    assert (dirs["secrets-redis"] / "password").read_text().strip() == creds.redis
    users = set(users_of(json.loads((dirs["secrets-nats"] / "nats.conf").read_text())))
    assert {"worker-gpu-1", "worker-cpu-1", "worker-cpu-2"} <= users
    generated = yaml.safe_load((tmp_path / "deploy" / "compose.workers.yaml").read_text())["services"]
    for worker in generated.values():
        assert all((tmp_path / path).exists() for path, _ in env_files(worker))
        assert worker["depends_on"]["nats-setup"]["condition"] == "service_completed_successfully"
    prometheus = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus
    assert (tmp_path / "deploy" / "prometheus.yml").exists()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[tuple[dict, dict[str, Path], Server, Server]]:
    """compose.yaml's init run, a nats-server with the users it wrote and a redis-server on its redis.conf."""
    compose = load("compose.yaml")
    dirs, done = run_init(compose, tmp_path / "volumes")
    assert done.returncode == 0, done.stderr
    nats = start_nats(free_port(), tmp_path / "nats", tmp_path / "nats.log", config=dirs["secrets-nats"] / "auth.conf")
    port = free_port()
    args = (
        redis_server_binary(),
        str(dirs["secrets-redis"] / "redis.conf"),
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""),
    )
    redis = Server(
        "redis", port, subprocess.Popen(args, stdout=subprocess.DEVNULL), f"redis://127.0.0.1:{port}/0", args
    )
    try:
        wait_port(port, 15, redis.proc)
        yield compose, dirs, nats, redis
    finally:
        redis.stop()
        nats.stop()


async def test_services_connect_with_the_credentials_in_their_volumes(
    started: tuple[dict, dict[str, Path], Server, Server],
) -> None:
    """A real nats-server with the users the init service wrote and a real redis-server started from its
    redis.conf admit each service by the password files its compose settings name, and refuse a guess."""
    compose, dirs, nats, redis = started
    checked = []
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        if "LF_NATS_USER" not in env:
            continue
        files = {k: in_volume(service, dirs, env[k]) for k in CREDENTIAL_FILES if k in env}
        settings = CommonSettings(
            nats_user=env["LF_NATS_USER"],
            nats_password_file=files["LF_NATS_PASSWORD_FILE"],
            redis_password_file=files.get("LF_REDIS_PASSWORD_FILE"),
        )
        nc = await connect(nats.url, f"test-{name}", settings.nats_credentials())
        await nc.close()
        if settings.redis_password_file is not None:
            client = connect_redis(redis.url, password=settings.redis_password())
            assert await client.ping()
            await client.aclose()
        checked.append(name)
    # nats-setup, gateway, registry, scheduler, auditor, the two workers, lorafleet-demo and cli (as admin)
    assert len(checked) == 9, checked
    with pytest.raises(nats_errors.Error):
        await nats_client.connect(nats.url, user="gateway", password="guess", allow_reconnect=False)
    anonymous = connect_redis(redis.url)
    with pytest.raises(redis_exceptions.AuthenticationError):
        await anonymous.ping()
    await anonymous.aclose()
