"""Reading compose files as compose does (YAML, `-f` overrides merged), and running their init service."""

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
INIT = "lorafleet-init"
WAITS = {"service_completed_successfully", "service_healthy"}  # conditions that wait for readiness


def load(*names: str) -> dict:
    """The project ``docker compose -f a -f b`` sees: services merged key by key, lists of volumes by target."""
    merged: dict = {}
    for name in names:
        for key, value in yaml.safe_load((REPO / name).read_text()).items():
            if key != "services":
                merged[key] = value if not isinstance(value, dict) else {**merged.get(key, {}), **value}
                continue
            services = merged.setdefault("services", {})
            for service, spec in value.items():
                services[service] = merge_service(services.get(service, {}), spec)
    return merged


def merge_service(base: dict, override: dict) -> dict:
    out = {**base}
    for key, value in override.items():
        if key == "volumes":
            by_target = {mount_target(v): v for v in base.get("volumes", [])}
            by_target.update({mount_target(v): v for v in value})
            out[key] = list(by_target.values())
        elif key in ("environment", "depends_on") and isinstance(value, dict):
            out[key] = {**base.get(key, {}), **value}
        elif key == "env_file":
            out[key] = [*base.get(key, []), *value]
        else:
            out[key] = value
    return out


def mount_source(volume: str) -> str:
    return volume.split(":")[0]


def mount_target(volume: str) -> str:
    return volume.split(":")[1]


def env_files(service: dict) -> list[tuple[str, bool]]:
    """(path, required) of each env_file entry, in either compose syntax."""
    return [
        (e, True) if isinstance(e, str) else (e["path"], e.get("required", True)) for e in service.get("env_file", [])
    ]


def secret_volumes(compose: dict) -> set[str]:
    """The named volumes the init service fills."""
    return {mount_source(v) for v in compose["services"][INIT]["volumes"] if not v.startswith(".")}


def waits_for_init(compose: dict, name: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether ``name`` starts only after the init service completed: directly, or through services
    it waits for (healthy or completed) that wait for it."""
    deps = compose["services"][name].get("depends_on", {})
    if isinstance(deps, list):
        deps = {d: {"condition": "service_started"} for d in deps}
    for dep, how in deps.items():
        if how.get("condition") not in WAITS or dep in seen:
            continue
        if dep == INIT and how["condition"] == "service_completed_successfully":
            return True
        if waits_for_init(compose, dep, seen | {name}):
            return True
    return False


def run_init(
    compose: dict, root: Path, skip: tuple[str, ...] = ()
) -> tuple[dict[str, Path], subprocess.CompletedProcess]:
    """Run the init service's own command with each of its volumes (but ``skip``) a directory under
    ``root``; returns volume -> directory and the finished process."""
    service = compose["services"][INIT]
    dirs: dict[str, Path] = {}
    command = list(service["command"])
    container_root = command[command.index("--root") + 1]
    for volume in service["volumes"]:
        source, target = mount_source(volume), mount_target(volume)
        if source.startswith("."):
            continue
        assert Path(target).parent == Path(container_root), volume
        dirs[source] = root / Path(target).name
        if source not in skip:
            dirs[source].mkdir(parents=True, exist_ok=True)
    command[command.index("--root") + 1] = str(root)
    assert command[:2] == ["python", "-m"]
    done = subprocess.run([sys.executable, *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    return dirs, done


def in_volume(service: dict, dirs: dict[str, Path], container_path: str) -> Path | None:
    """Where ``container_path`` of ``service`` lies among the init's volume directories, if in one."""
    for volume in service.get("volumes", []):
        source, target = mount_source(volume), mount_target(volume)
        if source in dirs and Path(container_path).is_relative_to(target):
            return dirs[source] / Path(container_path).relative_to(target)
    return None
