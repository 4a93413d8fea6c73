"""compose.cluster.yaml: three NATS nodes routed to each other, replicated services behind a load
balancer; Prometheus reaches every service where its /metrics listens, and the Grafana dashboard asks
only for metrics the code exports."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import prometheus_client
import pytest
import yaml

import shared.metrics  # noqa: F401  (registers every metric family the services export)
from lorafleet.cli.infra import nats_server_binary
from tests.deploy.compose_files import REPO, load, mount_source, mount_target, run_init

CLUSTER = load("compose.cluster.yaml")
SERVICES = CLUSTER["services"]
NODES = ("nats-1", "nats-2", "nats-3")
PROJECTS = {
    "compose.yaml": "deploy/compose/prometheus.yml",
    "compose.cluster.yaml": "deploy/compose/prometheus-cluster.yml",
}
DASHBOARD = REPO / "deploy/compose/grafana/dashboards/lorafleet.json"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def module_of(service: dict) -> str | None:
    command = service.get("command", [])
    return command[2] if command[:2] == ["python", "-m"] and command[2].startswith("services.") else None


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs, done = run_init(CLUSTER, tmp_path_factory.mktemp("cluster"))
    assert done.returncode == 0, done.stderr
    return dirs


def test_the_profile_has_every_replica() -> None:
    assert {
        *NODES,
        "redis",
        "lorafleet-init",
        "nats-setup",
        "gateway-1",
        "gateway-2",
        "lb",
        "registry-1",
        "registry-2",
        "scheduler-1",
        "scheduler-2",
        "auditor",
        "worker-cpu-1",
        "worker-cpu-2",
    } <= set(SERVICES)
    modules = [module_of(s) for s in SERVICES.values()]
    for name, count in {"gateway": 2, "registry": 2, "scheduler": 2, "worker": 2, "auditor": 1}.items():
        assert modules.count(f"services.{name}") == count, name
    nats = [n for n, s in SERVICES.items() if s.get("image", "").startswith("nats:")]
    assert sorted(nats) == list(NODES)
    assert len({mount_source(v) for n in NODES for v in SERVICES[n]["volumes"] if mount_target(v) == "/data"}) == 3


def test_every_client_knows_all_nodes_and_replicates_three_times() -> None:
    urls = {f"nats://{node}:4222" for node in NODES}
    clients = [s for s in SERVICES.values() if "LF_NATS_URL" in s.get("environment", {})]
    assert len(clients) >= 10
    for service in clients:
        assert set(service["environment"]["LF_NATS_URL"].split(",")) == urls
        assert service["environment"]["LF_JETSTREAM_REPLICAS"] == "3"
    setup = SERVICES["nats-setup"]["depends_on"]
    assert all(setup[node]["condition"] == "service_healthy" for node in NODES)


def node_config(name: str, volumes: dict[str, Path], root: Path) -> Path:
    """A node's container filesystem as far as its config reaches: the shipped file and the secrets volume."""
    service = SERVICES[name]
    for volume in service["volumes"]:
        source, target = mount_source(volume), mount_target(volume)
        where = root / target.lstrip("/")
        where.parent.mkdir(parents=True, exist_ok=True)
        if source.startswith("./"):
            shutil.copy(REPO / source, where)
        elif source in volumes:
            where.symlink_to(volumes[source], target_is_directory=True)
    return root / service["command"][service["command"].index("-c") + 1].lstrip("/")


def test_each_node_config_is_accepted_and_routes_to_every_node(volumes: dict[str, Path], tmp_path: Path) -> None:
    fragment = (volumes["secrets-nats"] / "cluster.conf").read_text()
    routes = json.loads(re.search(r"^routes: (.*)$", fragment, re.M).group(1))  # type: ignore[union-attr]
    assert sorted(re.search(r"@([\w-]+):6222$", r).group(1) for r in routes) == list(NODES)  # type: ignore[union-attr]
    shipped = (REPO / "deploy/compose/nats-cluster.conf").read_text()
    assert "listen: 0.0.0.0:6222" in shipped and "jetstream" in shipped
    for node in NODES:
        config = node_config(node, volumes, tmp_path / node)
        env = SERVICES[node]["environment"]
        assert env["NATS_SERVER_NAME"] == node
        done = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(config)],
            capture_output=True,
            text=True,
            timeout=30,
            env={"NATS_SERVER_NAME": env["NATS_SERVER_NAME"]},
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_load_balancer_names_both_gateways() -> None:
    lb = SERVICES["lb"]
    conf_mount = next(v for v in lb["volumes"] if mount_target(v) == "/etc/nginx/nginx.conf")
    conf = (REPO / mount_source(conf_mount)).read_text()
    upstream = re.search(r"upstream gateways \{(.*?)\}", conf, re.S)
    assert upstream
    servers = set(re.findall(r"^\s*server ([\w.-]+:\d+)", upstream.group(1), re.M))
    gateways = {n: s for n, s in SERVICES.items() if module_of(s) == "services.gateway"}
    assert servers == {f"{n}:{s['environment']['LF_PORT']}" for n, s in gateways.items()}
    assert "proxy_pass http://gateways;" in conf and "proxy_buffering off;" in conf  # streams pass through
    listen = re.search(r"^\s*listen (\d+);", conf, re.M)
    assert listen and lb["ports"] == [f"${{LF_GATEWAY_PORT:-8000}}:{listen.group(1)}"]
    assert all("ports" not in s for s in gateways.values())  # reached only through the balancer
    assert set(lb["depends_on"]) == set(gateways)


@pytest.mark.parametrize("project", sorted(PROJECTS))
def test_prometheus_scrapes_every_service_where_its_metrics_listen(project: str) -> None:
    services = load(project)["services"]
    prometheus = services["prometheus"]
    assert f"./{PROJECTS[project]}:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    scrape = yaml.safe_load((REPO / PROJECTS[project]).read_text())
    targets = {
        t: job["job_name"] for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    expected = {}
    for name, service in services.items():
        module = module_of(service)
        if module is None:
            continue
        env = service["environment"]
        if module == "services.gateway":
            port = env["LF_PORT"]
            assert env["LF_HOST"] == "0.0.0.0", name
        else:
            port = env["LF_METRICS_PORT"]
            assert env["LF_METRICS_HOST"] == "0.0.0.0" and int(port) > 0, name
        expected[f"{name}:{port}"] = module.removeprefix("services.")
    assert targets == expected


def promql_metrics(expr: str) -> set[str]:
    """The metric names one PromQL expression selects."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end() :].lstrip()
        if not rest.startswith("(") and match.group(0) not in PROMQL_WORDS:
            names.add(match.group(0))
    return names


def test_promql_metrics_reads_selectors_not_functions() -> None:
    expr = 'histogram_quantile(0.95, sum by (le, slo_class) (rate(slo_ttft_ms_bucket{x="a b"}[5m]))) / up'
    assert promql_metrics(expr) == {"slo_ttft_ms_bucket", "up"}


def test_every_dashboard_expression_names_an_exported_metric() -> None:
    exported = set(prometheus_client.REGISTRY._names_to_collectors) | {"up"}  # up: Prometheus's own per target
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "lorafleet-prometheus"
        for target in panel["targets"]:
            names = promql_metrics(target["expr"])
            assert names and names <= exported, (panel["title"], names - exported)
            used |= names
    for wanted in (
        "ttft_ms_bucket",
        "tpot_ms_bucket",
        "queue_depth",
        "adapter_cache_lookups_total",
        "slo_attainment_ratio",
        "scheduler_shed_total",
    ):
        assert wanted in used, wanted


def test_grafana_provisions_the_datasource_and_the_dashboard() -> None:
    for project in PROJECTS:
        grafana = load(project)["services"]["grafana"]
        mounts = {mount_target(v): mount_source(v) for v in grafana["volumes"]}
        provisioning = REPO / mounts["/etc/grafana/provisioning"]
        datasources = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())["datasources"]
        assert datasources[0]["uid"] == "lorafleet-prometheus" and datasources[0]["url"] == "http://prometheus:9090"
        providers = yaml.safe_load((provisioning / "dashboards/lorafleet.yml").read_text())["providers"]
        path = providers[0]["options"]["path"]
        assert (REPO / mounts[path] / DASHBOARD.name).is_file()
        assert "prometheus" in grafana["depends_on"]
