"""deploy/k8s: the base and each overlay, rendered as Kustomize does (here by applying the overlays'
patches in the test; compared with `kubectl kustomize` where kubectl is on PATH), are valid for a
pinned Kubernetes release; every Secret key a container reads is written by create-secrets.sh's own
command, the NATS nodes' config is accepted by nats-server and routes to every pod, and the replicas,
Services, probes and GPU workers are what docs/operations.md promises."""

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from lorafleet.cli.compose_services import compose_worker
from lorafleet.cli.healthcheck import build_parser
from lorafleet.cli.infra import nats_server_binary
from services.auditor.settings import AuditorSettings
from services.gateway.settings import GatewaySettings
from services.registry.settings import RegistrySettings
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings
from shared.config import CommonSettings
from tests.deploy.compose_files import K8S, REPO

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
