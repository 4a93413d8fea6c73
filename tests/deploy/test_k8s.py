"""deploy/k8s: the base and each overlay, rendered as Kustomize does (here by applying the overlays'
patches in the test; compared with `kubectl kustomize` where kubectl is on PATH), are valid for a
pinned Kubernetes release; every Secret key a container reads is written by create-secrets.sh's own
command, the NATS nodes' config is accepted by nats-server and routes to every pod, and the replicas,
Services, probes and GPU workers are what docs/operations.md promises."""

import re
import shlex
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import nats
import nats.errors
import pytest
import yaml

from lorafleet.cli.compose_init import NATS_UID
from lorafleet.cli.healthcheck import build_parser
from lorafleet.cli.infra import free_port, nats_server_binary, start_nats
from lorafleet.cli.nats_auth import compose_worker
from services.worker.settings import WorkerSettings
from shared.config import AuditorSettings, CommonSettings, GatewaySettings, SchedulerSettings
from shared.registry_config import RegistrySettings
from tests.deploy.compose_files import REPO
from tests.deploy.network_policy import EXTERNAL, Pod, reachable

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # the release the manifests are validated against
OVERLAYS = ("cpu", "gpu")
SETTINGS = {
    "services.gateway": GatewaySettings,
    "services.registry": RegistrySettings,
    "services.scheduler": SchedulerSettings,
    "services.auditor": AuditorSettings,
    "services.worker": WorkerSettings,
    "lorafleet.cli.nats_auth": CommonSettings,
}
NAMESPACED_NOT = {"Namespace"}


def merge(base: object, patch: object) -> object:
    """A strategic merge patch as Kustomize applies it to these manifests: maps merge, lists of named
    items (containers, env, ports, volumes) merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and named_items(base) and named_items(patch):
        items = {i["name"]: i for i in base}
        for item in patch:
            items[item["name"]] = merge(items[item["name"]], item) if item["name"] in items else item
        return list(items.values())
    return patch


def named_items(items: list) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def build(directory: Path) -> list[dict]:
    """The resources of a kustomization: its resources (files or kustomizations), then its namespace,
    labels and patches."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        resources += build(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for resource in resources:
        if "namespace" in kustomization and resource["kind"] not in NAMESPACED_NOT:
            resource["metadata"]["namespace"] = kustomization["namespace"]
        for label in kustomization.get("labels", []):
            resource["metadata"]["labels"] = {**resource["metadata"].get("labels", {}), **label["pairs"]}
    for entry in kustomization.get("patches", []):
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        target = entry["target"]
        hits = [
            i
            for i, r in enumerate(resources)
            if r["kind"] == target["kind"] and re.fullmatch(target["name"], r["metadata"]["name"])
        ]
        assert hits, entry
        for i in hits:
            named = {**patch, "metadata": {**patch["metadata"], "name": resources[i]["metadata"]["name"]}}
            resources[i] = merge(resources[i], named)  # type: ignore[assignment]
    return resources


RENDERED = {overlay: build(K8S / "overlays" / overlay) for overlay in OVERLAYS}


def of_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def containers(resources: list[dict]) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every workload."""
    out = []
    for r in resources:
        if r["kind"] in ("Deployment", "StatefulSet", "Job"):
            pod = r["spec"]["template"]["spec"]
            out += [(pod, c) for c in pod["containers"]]
    return out


def env_of(container: dict, config: dict[str, str]) -> dict[str, str]:
    env = dict(config) if container.get("envFrom") else {}
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid_for_the_pinned_kubernetes(overlay: str) -> None:
    resources = RENDERED[overlay]
    assert len(resources) >= 20
    for resource in resources:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    deployment = dict(of_kind(RENDERED["cpu"], "Deployment")["gateway"])
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def normalised(value: object) -> object:
    """Lists of named items as maps (their order is Kustomize's business), everything else as is."""
    if isinstance(value, dict):
        return {k: normalised(v) for k, v in value.items()}
    if isinstance(value, list) and value and named_items(value):
        return {i["name"]: normalised(i) for i in value}
    if isinstance(value, list):
        return [normalised(i) for i in value]
    return value


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not on PATH: overlays rendered by the test only"
)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_kustomize_renders_the_same_overlay(overlay: str) -> None:
    done = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d]
    for resource in theirs:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert {key(r): normalised(r) for r in theirs} == {key(r): normalised(r) for r in RENDERED[overlay]}


@pytest.fixture(scope="module")
def secret_dirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directories create-secrets.sh fills, by its own compose_init command."""
    script = (K8S / "create-secrets.sh").read_text()
    consumers = re.search(r"^for consumer in (.*); do\n  mkdir", script, re.M)
    command = re.search(r"^python -m lorafleet\.cli\.compose_init (.*)$", script, re.M)
    assert consumers and command
    root = tmp_path_factory.mktemp("k8s-secrets")
    for consumer in consumers.group(1).split():
        (root / consumer).mkdir()
    args = shlex.split(command.group(1).replace('"$dir"', str(root)))
    done = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli.compose_init", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    certs = subprocess.run(
        ["sh", str(K8S / "make-nats-certs.sh"), str(root / "nats-tls")], capture_output=True, text=True, timeout=60
    )
    assert certs.returncode == 0, certs.stderr
    # the Secrets create-secrets.sh makes of them: the nodes' certificate, key and CA; the CA alone for clients
    assert '--from-file=ca.crt="$dir/nats-tls/ca.crt"' in script and "lorafleet-nats-ca" in script
    (root / "nats-ca").mkdir()
    (root / "nats-ca" / "ca.crt").write_text((root / "nats-tls" / "ca.crt").read_text())
    return root


def mounted(pod: dict, container: dict, path: str, secrets: Path, config_maps: dict[str, dict]) -> str | None:
    """The content a container reads at ``path``, from a Secret (a consumer directory) or a ConfigMap."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        target = Path(mount["mountPath"])
        if not Path(path).is_relative_to(target):
            continue
        volume = volumes[mount["name"]]
        key = mount.get("subPath") or Path(path).relative_to(target).as_posix()
        if "secret" in volume:
            consumer = volume["secret"]["secretName"].removeprefix("lorafleet-")
            file = secrets / consumer / key
            return file.read_text() if file.is_file() else None
        if "configMap" in volume:
            return config_maps[volume["configMap"]["name"]]["data"].get(key)
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_a_container_reads_is_made_by_create_secrets(overlay: str, secret_dirs: Path) -> None:
    resources = RENDERED[overlay]
    config_maps = of_kind(resources, "ConfigMap")
    config = config_maps["lorafleet-env"]["data"]
    readers = 0
    for pod, container in containers(resources):
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert (secret_dirs / volume["secret"]["secretName"].removeprefix("lorafleet-")).is_dir()
        env = env_of(container, config)
        for key in ("LF_NATS_PASSWORD_FILE", "LF_REDIS_PASSWORD_FILE"):
            if key in env:
                assert mounted(pod, container, env[key], secret_dirs, config_maps), (container["name"], key)
                readers += 1
        if "LF_NATS_USER" in env:
            user = env["LF_NATS_USER"]
            password = mounted(pod, container, env["LF_NATS_PASSWORD_FILE"], secret_dirs, config_maps)
            assert password == (secret_dirs / user / "nats-password").read_text(), user  # its own user's
    assert readers >= 10
    redis_pod, redis = next((p, c) for p, c in containers(resources) if c["name"] == "redis")
    assert (mounted(redis_pod, redis, redis["args"][1], secret_dirs, config_maps) or "").startswith("requirepass ")


def materialise(pod: dict, container: dict, path: str, secrets: Path, config_maps: dict[str, dict], root: Path) -> Path:
    """Write the file a container reads at ``path`` under ``root``, as it sees it; its local path."""
    content = mounted(pod, container, path, secrets, config_maps)
    assert content is not None, path
    local = root / path.lstrip("/")
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(content)
    return local


def node_config(secret_dirs: Path, root: Path) -> Path:
    """A NATS node's config with its includes and TLS files written under ``root``, paths pointing there."""
    resources = RENDERED["cpu"]
    nats = of_kind(resources, "StatefulSet")["nats"]
    pod = nats["spec"]["template"]["spec"]
    container = pod["containers"][0]
    config_path = container["args"][container["args"].index("-c") + 1]
    config_maps = of_kind(resources, "ConfigMap")
    config = materialise(pod, container, config_path, secret_dirs, config_maps, root)
    text = config.read_text()
    for include in re.findall(r'include "([^"]+)"', text):
        materialise(pod, container, (Path(config_path).parent / include).as_posix(), secret_dirs, config_maps, root)
    for path in sorted(set(re.findall(r"(?:cert|key|ca)_file: (\S+)", text))):
        local = materialise(pod, container, path, secret_dirs, config_maps, root)
        text = text.replace(f" {path}\n", f" {local}\n")
    config.write_text(text)
    return config


def test_nats_nodes_accept_their_config_and_route_to_every_pod(secret_dirs: Path, tmp_path: Path) -> None:
    resources = RENDERED["cpu"]
    nats = of_kind(resources, "StatefulSet")["nats"]
    pods = [f"nats-{i}.{nats['spec']['serviceName']}" for i in range(nats["spec"]["replicas"])]
    assert nats["spec"]["replicas"] == 3 and nats["spec"]["serviceName"] in of_kind(resources, "Service")
    routes = re.findall(r"@([\w.-]+):6222", (secret_dirs / "nats" / "cluster.conf").read_text())
    assert sorted(routes) == pods
    urls = of_kind(resources, "ConfigMap")["lorafleet-env"]["data"]["LF_NATS_URL"].split(",")
    assert sorted(urls) == [f"tls://{p}:4222" for p in pods]
    assert of_kind(resources, "ConfigMap")["lorafleet-env"]["data"]["LF_JETSTREAM_REPLICAS"] == "3"
    container = nats["spec"]["template"]["spec"]["containers"][0]
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    done = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(node_config(secret_dirs, tmp_path / "node"))],
        capture_output=True,
        text=True,
        timeout=30,
        env={"NATS_SERVER_NAME": "nats-0"},
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_services_and_probes(overlay: str) -> None:
    from types import SimpleNamespace

    from services.gateway.app import create_app

    resources = RENDERED[overlay]
    deployments = of_kind(resources, "Deployment")
    assert {n: d["spec"]["replicas"] for n, d in deployments.items() if n in ("gateway", "registry", "scheduler")} == {
        "gateway": 2,
        "registry": 2,
        "scheduler": 2,
    }
    service = of_kind(resources, "Service")["gateway"]
    gateway = deployments["gateway"]["spec"]["template"]
    assert service["spec"]["selector"].items() <= gateway["metadata"]["labels"].items()
    port = service["spec"]["ports"][0]["targetPort"]
    container = gateway["spec"]["containers"][0]
    assert port in {p["name"] for p in container["ports"]}
    routes = {
        getattr(r, "path", "")
        for r in create_app(SimpleNamespace(settings=SimpleNamespace(max_body_bytes=1024))).routes
    }
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz" in routes
    config = of_kind(resources, "ConfigMap")["lorafleet-env"]["data"]
    for _, c in containers(resources):
        module = c.get("command", [None, None, None])[2]
        if module not in SETTINGS:
            continue
        env = env_of(c, config)
        for key in env:
            assert key.startswith("LF_") and key[3:].lower().split("__")[0] in SETTINGS[module].model_fields, (
                key,
                module,
            )
        if module.startswith("services.") and module != "services.gateway":
            for probe in ("readinessProbe", "livenessProbe"):
                test = c[probe]["exec"]["command"]
                assert test[:3] == ["python", "-m", "lorafleet.cli.healthcheck"], c["name"]
                assert build_parser().parse_args(test[3:]).service == module.removeprefix("services.")
    assert sum(1 for _, c in containers(resources) if c.get("command", [])[2:3] == ["services.worker"]) == 2


def test_gpu_workers_request_a_gpu_and_run_the_vllm_image() -> None:
    vllm_image = compose_worker("vllm-1")["image"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert compose_worker("vllm-1")["build"]["target"] == "vllm-worker" and "AS vllm-worker" in dockerfile
    for overlay in OVERLAYS:
        workers = [c for _, c in containers(RENDERED[overlay]) if c.get("command", [])[2:3] == ["services.worker"]]
        for worker in workers:
            env = {e["name"]: e.get("value") for e in worker["env"]}
            if overlay == "gpu":
                assert worker["image"] == vllm_image and env["LF_WORKER_ENGINE"] == "vllm"
                assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
            else:
                assert worker["image"] == "lorafleet:cpu" and env["LF_ENGINE__DEVICE"] == "cpu"
                assert "nvidia.com/gpu" not in str(worker["resources"])


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
