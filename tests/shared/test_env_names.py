"""The ``LF_*`` names lorafleet knows (shared/env_names.py) are exactly what its settings models and code
read, every name the repository spells (docs, compose files, deploy/, the Makefile, tests) is one of them,
and a service refuses to start on one it does not know, naming the closest known."""

import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from shared.env_names import DIRECT, KNOWN, SETTINGS, UnknownVariables, check_environment, model_env_names

REPO = Path(__file__).resolve().parents[2]
CODE = ("shared", "services", "kernels", "lorafleet", "bench", "tools")
NAME = re.compile(r"(?<![A-Za-z0-9_])LF_[A-Z0-9_]+")


TOP = ("README.md", "Makefile", "Dockerfile", "pyproject.toml", ".ci/run")
SKIPPED = {"__pycache__", "results", "secrets", "tls", "csrc"}  # generated, local state, C macros (kernels/csrc)


def repository_files(*roots: str, suffix: str = "") -> Iterator[Path]:
    """The checkout's own files under ``roots`` (no git: a fast-tier test starts no process)."""
    for root in roots:
        for path in sorted((REPO / root).rglob(f"*{suffix}")):
            if path.is_file() and not SKIPPED & set(path.relative_to(REPO).parts):
                yield path


def settings_models() -> set[type[BaseSettings]]:
    """Every settings model the code defines: the modules that configure one, imported, then BaseSettings'
    subclasses (a new model in a new module is found too)."""
    for path in repository_files(*CODE[:4], suffix=".py"):
        # a model named *Settings, or one deriving from a settings class (GatewaySettings(RequestBounds) too)
        if re.search(r"^class (\w*Settings\w*\(|\w+\([^)]*(Settings|WorkerIdentity))", path.read_text(), flags=re.M):
            importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
    found: set[type[BaseSettings]] = set()
    todo = [BaseSettings]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.split(".")[0] in CODE and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_the_known_settings_are_exactly_what_the_models_read() -> None:
    read = set().union(*(model_env_names(model) for model in settings_models()))
    assert {"LF_ENGINE__DTYPE", "LF_KERNELS_DIR", "LF_NATS_URL", "LF_REMOTE__S3_REGION"} <= read
    assert sorted(read - SETTINGS) == [], "read by a settings model: add to shared/env_names.py SETTINGS"
    assert sorted(SETTINGS - read) == [], "no settings model reads these: remove from SETTINGS"


def test_every_name_the_code_reads_directly_is_known() -> None:
    literals = {
        name
        for path in repository_files(*CODE, suffix=".py")
        for name in re.findall(r"[\"'](LF_[A-Z0-9_]*[A-Z0-9])[\"']", path.read_text())
    }
    assert sorted(literals - KNOWN) == []
    assert sorted(DIRECT - literals) == [], "no code reads these with os.environ: remove from DIRECT"


def test_every_name_the_repository_spells_is_known() -> None:
    """Docs, README, compose files, deploy/, Makefile, Dockerfile, tests, benchmarks: a name ending in
    ``_`` is a prefix (``LF_DEFAULT_QUOTA__<FIELD>``) some known name must start with. The C macros of
    kernels/csrc are not environment variables."""
    unknown: dict[str, set[str]] = {}
    files = [
        *(REPO / name for name in TOP),
        *REPO.glob("compose*.yaml"),
        *repository_files(*CODE, "deploy", "docs", "examples", "tests"),
    ]
    assert {"compose.yaml", "operations.md", "Makefile", "create-secrets.sh"} <= {f.name for f in files}
    for path in files:
        if path.suffix == ".safetensors":
            continue
        for name in NAME.findall(path.read_text(errors="replace")):
            if not (name in KNOWN or (name.endswith("_") and any(k.startswith(name) for k in KNOWN))):
                unknown.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert unknown == {}


def test_tooling_names_and_any_case_of_a_setting_pass() -> None:
    check_environment({"LF_TEST_TIER": "fast", "lf_engine__dtype": "bfloat16", "PATH": "/bin", "LFX": "1"})


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("LF_" + "DTYPE", "(did you mean LF_ENGINE__DTYPE or LF_VLLM__DTYPE?)"),  # the docs' old spelling
        ("LF_" + "DEVICE", "(did you mean LF_ENGINE__DEVICE?)"),
        ("LF_ENGINE_" + "DTYPE", "(did you mean LF_ENGINE__DTYPE?)"),  # one underscore: not nested
        ("LF_ENGINE__" + "DTYP", "(did you mean LF_ENGINE__DTYPE?)"),
        ("LF_" + "ZZZZZZZZZ", ""),
    ],
)
def test_an_unknown_name_is_refused_with_the_closest_known(name: str, suggested: str) -> None:
    with pytest.raises(UnknownVariables) as refused:
        check_environment({name: "x", "LF_NATS_URL": "nats://127.0.0.1:4222"})
    assert refused.value.names == [name]
    assert str(refused.value) == f"unknown variable {name} {suggested}".rstrip()


def test_a_service_with_an_unknown_variable_exits_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LF_")}
    env.update({"LF_" + "DTYPE": "bfloat16", "LF_NATS_URL": "nats://127.0.0.1:1"})
    done = subprocess.run(
        [sys.executable, "-m", "services.auditor"], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        f"invalid configuration: unknown variable {'LF_' + 'DTYPE'} (did you mean LF_ENGINE__DTYPE or LF_VLLM__DTYPE?) "
        "(python -m services.<name> --help lists them)"
    ]


def test_lorafleet_up_refuses_an_unknown_variable_before_starting_anything(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LF_")}
    env["LF_ENGINE_" + "DTYPE"] = "bfloat16"
    done = subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", "up", "--state-dir", str(tmp_path / "state")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stdout.strip() == (
        f"invalid configuration: unknown variable {'LF_ENGINE_' + 'DTYPE'} (did you mean LF_ENGINE__DTYPE?)"
    )
    assert not (tmp_path / "state").exists()  # no nats-server, redis-server or service was started
