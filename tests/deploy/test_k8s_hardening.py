"""The k8s manifests' hardening: default-deny NetworkPolicies that allow exactly the flows the services
use, non-root pods, NATS monitoring kept inside its pod, NATS over verified TLS and /metrics behind the
token (the manifests rendered as in tests/deploy/test_k8s.py)."""

import re
import ssl
from pathlib import Path

import nats
import nats.errors
import pytest

from lorafleet.cli.compose_init import NATS_UID
from lorafleet.cli.infra import free_port, start_nats
from shared.config import CommonSettings
from tests.deploy.network_policy import EXTERNAL, Pod, reachable
from tests.deploy.test_k8s import OVERLAYS, RENDERED, containers, env_of, mounted, node_config, of_kind


def pods_of(resources: list[dict]) -> dict[str, Pod]:
    """Each workload's pods, by workload name, as NetworkPolicies see them."""
    return {
        r["metadata"]["name"]: Pod(r["metadata"]["namespace"], r["spec"]["template"]["metadata"]["labels"])
        for r in resources
        if r["kind"] in ("Deployment", "StatefulSet", "Job")
    }


PROMETHEUS_POD = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"})
INTRUDER = Pod("default", {"app.kubernetes.io/name": "prometheus-lookalike"})
DNS = Pod("kube-system", {"k8s-app": "kube-dns"})
OUTSIDE = Pod(EXTERNAL)
CLIENTS = ("gateway", "registry", "scheduler", "auditor", "worker-1", "worker-2", "nats-setup")
REDIS_CLIENTS = ("scheduler", "worker-1", "worker-2")
METRICS = {"registry": 9100, "scheduler": 9100, "auditor": 9100, "worker-1": 9100, "worker-2": 9100, "gateway": 8000}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_flows_the_services_use(overlay: str) -> None:
    resources = RENDERED[overlay]
    policies = list(of_kind(resources, "NetworkPolicy").values())
    pods = pods_of(resources)
    assert set(CLIENTS) | {"nats", "redis"} == set(pods)
    for name, pod in pods.items():
        assert reachable(policies, pod, DNS, 53, "UDP"), name
        assert not reachable(policies, pod, OUTSIDE, 443), name  # nothing leaves the cluster
        assert not reachable(policies, INTRUDER, pod, 9100) and not reachable(policies, OUTSIDE, pod, 9100), name
        assert not reachable(policies, pod, pods["nats"], 8222), name  # monitoring: the node's loopback only
    assert reachable(policies, OUTSIDE, pods["gateway"], 8000) and reachable(policies, INTRUDER, pods["gateway"], 8000)
    for name in CLIENTS:
        assert reachable(policies, pods[name], pods["nats"], 4222), name
        assert not reachable(policies, pods[name], pods["nats"], 6222), name
        assert reachable(policies, pods[name], pods["redis"], 6379) == (name in REDIS_CLIENTS), name
    assert reachable(policies, pods["nats"], pods["nats"], 6222)
    assert not reachable(policies, INTRUDER, pods["nats"], 4222) and not reachable(
        policies, OUTSIDE, pods["nats"], 4222
    )
    assert not reachable(policies, INTRUDER, pods["redis"], 6379)
    assert not reachable(policies, pods["worker-1"], pods["worker-2"], 9100)  # only Prometheus scrapes
    for name, port in METRICS.items():
        assert reachable(policies, PROMETHEUS_POD, pods[name], port), name


def test_the_policy_model_refuses_and_allows_as_kubernetes_does() -> None:
    a, b = Pod("ns", {"app": "a"}), Pod("ns", {"app": "b"})
    assert reachable([], a, b, 80)  # no policy: open
    deny = {"metadata": {"namespace": "ns"}, "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}}
    assert not reachable([deny], a, b, 80)
    allow_b = {
        "metadata": {"namespace": "ns"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "b"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": 80}]}],
        },
    }
    allow_a_out = {
        "metadata": {"namespace": "ns"},
        "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{"to": [{"podSelector": {}}]}]},
    }
    assert not reachable([deny, allow_b], a, b, 80)  # a's egress is still denied
    assert reachable([deny, allow_b, allow_a_out], a, b, 80) and not reachable([deny, allow_b, allow_a_out], a, b, 81)
    assert not reachable([deny, allow_b, allow_a_out], Pod("other", {"app": "a"}), b, 80)  # another namespace


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_as_a_non_root_user(overlay: str) -> None:
    for pod, container in containers(RENDERED[overlay]):
        context = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        assert context.get("runAsNonRoot") is True and context.get("runAsUser", 0) != 0, container["name"]
        assert container.get("securityContext", {}).get("allowPrivilegeEscalation") is False, container["name"]
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], container["name"]
    nats = of_kind(RENDERED[overlay], "StatefulSet")["nats"]["spec"]["template"]["spec"]
    assert nats["securityContext"]["runAsUser"] == NATS_UID and nats["securityContext"]["fsGroup"] == NATS_UID
    for volume in nats["volumes"]:
        if "secret" in volume:  # root-owned files of group fsGroup: nats-server reads them as that group
            assert volume["secret"]["defaultMode"] & 0o040, volume["name"]


def test_nats_monitoring_is_neither_exposed_nor_bound_beyond_the_pod() -> None:
    resources = RENDERED["cpu"]
    for service in of_kind(resources, "Service").values():
        assert all(p["port"] != 8222 for p in service["spec"]["ports"]), service["metadata"]["name"]
    nats = of_kind(resources, "StatefulSet")["nats"]["spec"]["template"]["spec"]["containers"][0]
    assert all(p["containerPort"] != 8222 for p in nats["ports"])
    text = of_kind(resources, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    assert re.search(r"^http: 127\.0\.0\.1:8222$", text, re.M)
    for probe in ("readinessProbe", "livenessProbe"):
        assert "http://127.0.0.1:8222/healthz" in " ".join(nats[probe]["exec"]["command"]), probe


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_client_verifies_nats_tls_and_every_metrics_endpoint_takes_the_token(
    overlay: str, secret_dirs: Path
) -> None:
    resources = RENDERED[overlay]
    config_maps = of_kind(resources, "ConfigMap")
    config = config_maps["lorafleet-env"]["data"]
    token = (secret_dirs / "prometheus" / "metrics-token").read_text()
    ca = (secret_dirs / "nats-tls" / "ca.crt").read_text()
    text = config_maps["nats-config"]["data"]["nats.conf"]
    assert text.count("tls {") == 2 and not re.search(r"^\s*verify:", text, re.M)  # passwords, not client certs
    assert all(url.startswith("tls://") for url in config["LF_NATS_URL"].split(","))
    clients = served = 0
    for pod, container in containers(resources):
        env = env_of(container, config)
        if "LF_NATS_USER" not in env:
            continue
        assert mounted(pod, container, env["LF_NATS_CA_FILE"], secret_dirs, config_maps) == ca, container["name"]
        clients += 1
        if env.get("LF_METRICS_HOST") == "0.0.0.0" and container["command"][2] != "lorafleet.cli.nats_auth":
            assert mounted(pod, container, env["LF_METRICS_TOKEN_FILE"], secret_dirs, config_maps) == token
            served += 1
    assert clients == 7 and served == 6


async def test_a_client_reaches_a_tls_node_only_when_it_verifies_the_ca(secret_dirs: Path, tmp_path: Path) -> None:
    """A nats-server with the nodes' TLS block, certificate and accounts; clients as the services connect."""
    config = node_config(secret_dirs, tmp_path / "node").read_text()
    tls = re.search(r"^tls \{.*?^\}", config, re.M | re.S)
    auth = re.search(r'^include "(secrets/auth\.conf)"', config, re.M)
    assert tls and auth
    port = free_port()
    server_conf = tmp_path / "node" / "etc" / "nats" / "test.conf"
    server_conf.write_text(f'listen: 127.0.0.1:{port}\n{tls.group(0)}\ninclude "{auth.group(1)}"\n')
    server = start_nats(port, tmp_path / "data", tmp_path / "nats.log", config=server_conf)
    user = ("gateway", (secret_dirs / "gateway" / "nats-password").read_text().strip())
    host = "nats-0.nats-headless"  # a name of the certificate; the socket goes to 127.0.0.1
    try:
        verified = CommonSettings(nats_ca_file=secret_dirs / "nats-ca" / "ca.crt").nats_tls()
        nc = await nats.connect(
            f"tls://127.0.0.1:{port}", user=user[0], password=user[1], tls=verified, tls_hostname=host
        )
        assert nc.is_connected and nc.connected_url is not None
        await nc.close()
        for context in (CommonSettings().nats_tls(), None):  # the system's CAs; no TLS at all
            with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
                await nats.connect(
                    f"tls://127.0.0.1:{port}" if context else f"nats://127.0.0.1:{port}",
                    user=user[0],
                    password=user[1],
                    tls=context,
                    tls_hostname=host,
                    allow_reconnect=False,
                    connect_timeout=2,
                )
    finally:
        server.stop()
