"""Both compose projects, hardened: nats-server runs as a non-root user that owns its data and config, its
monitoring port stays inside the container, every /metrics takes the bearer token lorafleet-init generates
(and Prometheus sends it), and Grafana has a generated admin password and no anonymous access."""

import json
import os
import re

import pytest
import yaml

from lorafleet.cli.compose_init import GRAFANA_UID, NATS_UID, PROMETHEUS_UID
from tests.deploy.compose_files import INIT, REPO, in_volume, load, mount_source, mount_target, run_init

PROJECTS = {"single": "compose.yaml", "cluster": "compose.cluster.yaml"}
PROMETHEUS = {"single": "deploy/compose/prometheus.yml", "cluster": "deploy/compose/prometheus-cluster.yml"}
AS_ROOT = os.geteuid() == 0  # files are handed to their readers' users only when init runs as root


@pytest.fixture(params=sorted(PROJECTS), scope="module")
def project(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    compose = load(PROJECTS[request.param])
    dirs, done = run_init(compose, tmp_path_factory.mktemp(request.param))
    assert done.returncode == 0, done.stderr
    return request.param, compose, dirs


def nats_nodes(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if s.get("image", "").startswith("nats:")}


def test_nats_runs_as_a_non_root_user_that_owns_its_data_and_config(project: tuple[str, dict, dict]) -> None:
    _, compose, dirs = project
    nodes = nats_nodes(compose)
    assert nodes
    command = compose["services"][INIT]["command"]
    handed = command[command.index("--nats-data") + 1].split(",")
    for name, node in nodes.items():
        assert node["user"] == f"{NATS_UID}:{NATS_UID}", name
        data = next(mount_source(v) for v in node["volumes"] if mount_target(v) == "/data")
        assert data in handed and data in dirs, (name, data)  # init hands the volume to NATS's user
        config = in_volume(node, dirs, "/etc/nats/secrets/nats.conf")
        assert config is not None and config.is_file(), name
        if AS_ROOT:
            assert dirs[data].stat().st_uid == NATS_UID and config.stat().st_uid == NATS_UID, name


def test_nats_monitoring_stays_inside_its_container(project: tuple[str, dict, dict]) -> None:
    kind, compose, dirs = project
    for name, node in nats_nodes(compose).items():
        assert "ports" not in node, name
        probe = " ".join(node["healthcheck"]["test"])
        assert "http://127.0.0.1:8222/" in probe, name
    if kind == "single":
        listen = json.loads((dirs["secrets-nats"] / "nats.conf").read_text())["http"]
    else:
        match = re.search(r"^http: (\S+)", (REPO / "deploy" / "compose" / "nats-cluster.conf").read_text(), re.M)
        assert match
        listen = match.group(1)
    assert listen == "127.0.0.1:8222"


def serves_metrics(env: dict) -> bool:
    """A service whose /metrics listens beyond its container's loopback."""
    return env.get("LF_METRICS_HOST", "127.0.0.1") != "127.0.0.1" or env.get("LF_HOST", "127.0.0.1") != "127.0.0.1"


def test_every_metrics_endpoint_takes_the_token_prometheus_sends(project: tuple[str, dict, dict]) -> None:
    kind, compose, dirs = project
    prometheus = compose["services"]["prometheus"]
    scrape = yaml.safe_load((REPO / PROMETHEUS[kind]).read_text())
    files = {job["authorization"]["credentials_file"] for job in scrape["scrape_configs"]}
    assert all(job["authorization"]["type"] == "Bearer" for job in scrape["scrape_configs"]) and len(files) == 1
    sent = in_volume(prometheus, dirs, files.pop())
    assert sent is not None and sent.is_file()
    token = sent.read_text().strip()
    assert len(token) >= 32
    if AS_ROOT:
        assert sent.stat().st_uid == PROMETHEUS_UID
    served = 0
    for name, service in compose["services"].items():
        env = service.get("environment", {})
        if not serves_metrics(env):
            continue
        required = in_volume(service, dirs, env.get("LF_METRICS_TOKEN_FILE", "/nowhere"))
        assert required is not None and required.read_text().strip() == token, name
        served += 1
    assert served >= 6


def test_grafana_has_a_generated_admin_password_and_no_anonymous_access(project: tuple[str, dict, dict]) -> None:
    _, compose, dirs = project
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and "GF_SECURITY_ADMIN_PASSWORD" not in env
    password = in_volume(grafana, dirs, env["GF_SECURITY_ADMIN_PASSWORD__FILE"])
    assert password is not None and len(password.read_text().strip()) >= 20 and password.read_text().strip() != "admin"
    if AS_ROOT:
        assert password.stat().st_uid == GRAFANA_UID
    assert grafana["depends_on"][INIT]["condition"] == "service_completed_successfully"


def test_a_second_init_run_keeps_the_token_and_the_password(project: tuple[str, dict, dict]) -> None:
    _, compose, dirs = project
    before = {p: p.read_text() for d in ("secrets-prometheus", "secrets-grafana") for p in dirs[d].iterdir()}
    _, done = run_init(compose, dirs["secrets-state"].parent)
    assert done.returncode == 0, done.stderr
    assert {p: p.read_text() for p in before} == before


@pytest.mark.skipif(not AS_ROOT, reason="init hands files to their readers only when it runs as root, as in compose")
def test_an_upgrade_hands_a_root_nats_its_files_and_data(project: tuple[str, dict, dict]) -> None:
    """A stack whose NATS ran as root: its config, unchanged, and its JetStream files become NATS's user's."""
    _, compose, dirs = project
    data = next(d for v, d in dirs.items() if v.startswith("nats-data"))
    stored = data / "jetstream" / "$G" / "streams" / "INFER" / "msgs" / "1.blk"
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(b"\0")
    nats_files = [*dirs["secrets-nats"].iterdir(), stored]
    for path in [*nats_files, dirs["secrets-nats"], data]:
        os.chown(path, 0, 0)
    _, done = run_init(compose, dirs["secrets-state"].parent)
    assert done.returncode == 0, done.stderr
    assert all(p.stat().st_uid == NATS_UID for p in [*nats_files, *stored.parents[:5]]), nats_files
