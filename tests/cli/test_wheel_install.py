"""The project installed as the image installs it: ``pip install`` of a wheel (not an editable checkout)
into a fresh environment that holds the base dependencies and nothing else (no ``dev`` extra). Every
service answers ``--help``, every ``lorafleet`` subcommand's ``--help`` runs (enumerated from the parser,
so a new one is covered), and the files the code reads load from site-packages, never from the checkout."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "services", "lorafleet", "kernels")  # what the services and the command import
SERVICES = ("gateway", "registry", "scheduler", "worker", "auditor")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from what the Dockerfile copies into its build stage."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for name in (*PACKAGES, "bench"):
        shutil.copytree(REPO / name, source / name, ignore=ignore)
    dist = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, source],
        check=True,
        timeout=300,
    )
    (built,) = dist.glob("lorafleet-*.whl")
    return built


def base_distributions() -> set[str]:
    """The distributions the base install pulls in: pyproject's dependencies and theirs, markers
    evaluated here, extras only where a requirement names them (never lorafleet's own extras)."""
    requirements = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [(Requirement(r), "") for r in requirements]
    found: set[str] = set()
    done: set[tuple[str, str]] = set()
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        for wanted in ("", *requirement.extras):
            if (name, wanted) in done:
                continue
            done.add((name, wanted))
            found.add(name)
            todo += [(Requirement(r), wanted) for r in importlib.metadata.distribution(name).requires or []]
    return found


def link_distributions(site: Path, names: set[str]) -> None:
    """Make ``names`` (installed in this interpreter's environment) importable in ``site`` by symlinks:
    a whole directory where no other distribution owns a file under it, else file by file (namespace
    packages such as opentelemetry/ are shared)."""
    dists = list(importlib.metadata.distributions(path=[p for p in sys.path if p.endswith("site-packages")]))
    source = Path(str(dists[0].locate_file("")))
    mine: list[Path] = []
    foreign: set[Path] = set()  # every directory holding a file of a distribution outside ``names``
    for dist in dists:
        files = [Path(str(f)) for f in dist.files or [] if not str(f).startswith("..")]
        if canonicalize_name(dist.metadata["Name"]) in names:
            mine += files
        else:
            foreign.update(parent for f in files for parent in f.parents)
    linked: set[Path] = set()
    for path in mine:
        top = next(p for p in (*reversed(path.parents[:-1]), path) if p not in foreign)
        if top in linked or any(parent in linked for parent in top.parents):
            continue
        linked.add(top)
        (site / top).parent.mkdir(parents=True, exist_ok=True)
        (site / top).symlink_to(source / top)


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment: the base dependencies, then ``pip install`` of the wheel; its bin directory."""
    env_dir = tmp_path_factory.mktemp("env")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", env_dir], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    link_distributions(site, base_distributions())
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel],
        check=True,
        timeout=300,
    )
    return env_dir / "bin"


def run(args: list[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``args`` with no PYTHONPATH, from a directory outside the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_carries_every_file_the_packages_hold(wheel: Path) -> None:
    tracked = subprocess.run(
        ["git", "ls-files", *PACKAGES], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split()
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    assert sorted(set(tracked) - shipped) == []


@pytest.fixture(scope="module")
def probe(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What tests/cli/wheel_probe.py found in the installed environment."""
    done = run([installed / "python", "-I", REPO / "tests" / "cli" / "wheel_probe.py"], tmp_path_factory.mktemp("cwd"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_installed_packages_load_their_files_from_site_packages(probe: dict) -> None:
    site = Path(probe["prefix"]) / "lib"
    for name, directory in probe["packages"].items():
        assert Path(directory).is_relative_to(site) and "site-packages" in directory, (name, directory)
    assert probe["dashboard"]["status"] == 200
    assert probe["dashboard"]["page"] == (REPO / "services" / "gateway" / "static" / "dashboard.html").read_text()
    from kernels import native_build

    assert len(probe["kernel_sources"]) == len(native_build.SOURCES + native_build.HEADERS)
    assert all(Path(s).is_relative_to(site) for s in probe["kernel_sources"])
    assert probe["kernel_extension"] == native_build.extension_name()  # the same sources, flags and CPU
    demos = probe["demo_adapters"]
    assert sorted(demos) == sorted(p.name for p in (REPO / "lorafleet" / "demo_adapters").iterdir() if p.is_dir())
    for name, demo in demos.items():
        assert Path(demo["dir"]).is_relative_to(site), name
        assert demo["eval_items"] > 0 and demo["adapter_files"] == ["adapter_config.json", "adapter_model.safetensors"]


def test_every_lorafleet_subcommand_answers_help(probe: dict, installed: Path, tmp_path: Path) -> None:
    helps = probe["helps"]
    from lorafleet.cli.main import build_parser

    top = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(top.choices) <= set(helps)  # type: ignore[arg-type]
    assert {"adapter push", "keys gen", "up", "kernels build", "kernels status"} <= set(helps)
    failed = {command: h for command, h in helps.items() if h["status"] != 0 or not h["usage"]}
    assert failed == {}
    script = run([installed / "lorafleet", "--help"], tmp_path)  # the console script the wheel installs
    assert script.returncode == 0 and script.stdout.startswith("usage: lorafleet"), script.stderr[-2000:]


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_starts_far_enough_to_answer_help(installed: Path, tmp_path: Path, service: str) -> None:
    done = run([installed / "python", "-I", "-m", f"services.{service}", "--help"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LF_NATS_URL" in done.stdout and "configured by environment variables" in done.stdout


def test_a_module_the_base_install_lacks_is_not_importable(installed: Path, tmp_path: Path) -> None:
    """The environment holds the base dependencies only: a dev-extra package (pytest) is absent, so a
    runtime import of one would fail the tests above as it fails in the image."""
    done = run([installed / "python", "-I", "-c", "import pytest"], tmp_path)
    assert done.returncode == 1 and "No module named 'pytest'" in done.stderr
