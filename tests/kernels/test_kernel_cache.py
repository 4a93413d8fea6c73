"""The native kernels' cache across processes (kernels/native_build.py): a build killed midway never
blocks the next (its torch ``lock`` file is removed under the builders' flock), a second build finds
the first, a prebuilt directory loads without a compiler, and a build that fails, overruns its bound
or waits past it on a live builder is one log line, after which the eager paths serve."""

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kernels import native_build
from tests.helpers.native import needs_toolchain

REPO = Path(__file__).resolve().parents[2]
LOAD = "from kernels import native; print('native', native.built(), native.native_decode(), native.native_lora())"


def env(**variables: str) -> dict[str, str]:
    """This environment with the checkout importable and ``variables`` set (LF_KERNELS_* of the test's own)."""
    own = {k: v for k, v in os.environ.items() if not k.startswith("LF_KERNELS_")}
    return own | {"PYTHONPATH": str(REPO)} | variables


def kernels_cli(*args: str | Path, timeout_s: float = 900, **variables: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lorafleet.cli", "kernels", *map(str, args)],
        env=env(**variables),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def load_in_child(timeout_s: float = 900, **variables: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LOAD], env=env(**variables), capture_output=True, text=True, timeout=timeout_s
    )


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def running_in(directory: Path) -> list[Path]:
    """/proc entries of the processes whose command line names ``directory`` (a build of it)."""
    return [p for p in Path("/proc").glob("[0-9]*") if str(directory) in _cmdline(p)]


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


# The C++ compiler of the killed-then-rebuilt cache: torch's builder runs $CXX from ninja, one
# `-c <source> -o <object>` per source, then the link. It compiles an empty unit in place of each
# source (the build, its flock, torch's lock and the record are the code under test, not g++'s work on
# the kernels: the session's own build compiles those, tests/conftest.py), so the rebuild takes
# seconds, not minutes. While <dir>/hold exists it marks <dir>/compiling and waits to be killed (a
# process whose command line names <dir>): the first build is killed midway, with torch's lock held, on
# that event rather than after a time.
SHIM = """#!/bin/bash
here=$(dirname "$0")
args=(); prev=
for a in "$@"; do
  if [ "$prev" = -c ]; then
    [ -e "$here/hold" ] && { touch "$here/compiling"; exec -a "$here/held-compiler" sleep 3600; }
    args+=("$here/empty.cpp")
  else
    args+=("$a")
  fi
  prev=$a
done
exec g++ "${args[@]}"
"""


def held_compiler(shim: Path) -> None:
    """SHIM as ``<shim>/c++``, its empty unit beside it, holding every compile (``hold``) until removed."""
    (shim / "empty.cpp").write_text("")
    (shim / "c++").write_text(SHIM)
    (shim / "c++").chmod(0o755)
    (shim / "hold").touch()


@pytest.fixture(scope="module")
def killed_then_built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, str]]:
    """A cache where a build was killed (-9, with its compilers) while torch's builder held its ``lock``,
    then built by the next ``lorafleet kernels build``: (directory, extension name, that build's output)."""
    cache = tmp_path_factory.mktemp("kernels")
    shim = tmp_path_factory.mktemp("cxx")
    held_compiler(shim)
    name = native_build.extension_name()
    first = subprocess.Popen(
        [sys.executable, "-m", "lorafleet.cli", "kernels", "build", "--dir", str(cache)],
        env=env(CXX=str(shim / "c++")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    torch_lock = cache / name / "lock"  # torch's builder holds it from before ninja until after the link
    try:
        wait_until(lambda: (shim / "compiling").exists(), 300, "the first build never started compiling")
        assert torch_lock.exists()
        (builder,) = children(first.pid)
        os.kill(first.pid, signal.SIGKILL)  # a worker (container) killed mid-build: its build child and compilers too
        os.killpg(builder, signal.SIGKILL)
        first.wait()
        assert torch_lock.exists() and native_build.find(cache, name) is None
        (shim / "hold").unlink()
        done = kernels_cli("build", "--dir", cache, CXX=str(shim / "c++"))
        assert done.returncode == 0, done.stdout + done.stderr
        yield cache, name, done.stdout
    finally:  # a build child outlives a killed builder (it finishes its build): not past the tests
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        for process in running_in(cache) + running_in(shim):
            with contextlib.suppress(ProcessLookupError):  # its group: the build child, ninja; a held compiler
                os.killpg(os.getpgid(int(process.name)), signal.SIGKILL)


@pytest.fixture(scope="module")
def built_here(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A cache holding a copy of this machine's real library (the session's build): (directory, name)."""
    try:
        found = native_build.library()
    except native_build.KernelBuildError as e:
        pytest.fail(f"the session's native kernels did not build: {e}")
    cache = tmp_path_factory.mktemp("built")
    shutil.copytree(found.path.parent, cache / found.path.parent.name, ignore=shutil.ignore_patterns("lock"))
    return cache, found.path.parent.name


@needs_toolchain
def test_a_build_killed_midway_does_not_block_the_next(killed_then_built: tuple[Path, str, str]) -> None:
    cache, name, output = killed_then_built
    assert "native_kernels_stale_lock_removed" in output
    assert f"kernels {name}: built in" in output
    assert native_build.find(cache, name) == cache / name / f"{name}.so"
    assert not (cache / name / "lock").exists()
    assert native_build.record(cache, name) is not None


@needs_toolchain
def test_a_second_build_finds_the_first_without_compiling(built_here: tuple[Path, str]) -> None:
    cache, name = built_here
    files = {f: f.stat().st_mtime_ns for f in cache.rglob("*")}
    again = kernels_cli("build", "--dir", cache, timeout_s=120)
    assert again.returncode == 0 and f"kernels {name}: already built (cache)" in again.stdout, again.stdout
    assert {f: f.stat().st_mtime_ns for f in cache.rglob("*")} == files  # nothing compiled, nothing written
    status = kernels_cli("status", "--dir", cache, timeout_s=120)
    assert status.returncode == 0 and f"loads: {cache / name / name}.so" in status.stdout, status.stdout


@needs_toolchain
def test_a_prebuilt_library_loads_without_a_compiler(built_here: tuple[Path, str], tmp_path: Path) -> None:
    cache, _ = built_here
    done = load_in_child(LF_KERNELS_PREBUILT=str(cache), LF_KERNELS_DIR=str(tmp_path), CXX="/bin/false")
    assert "native True True True" in done.stdout, done.stdout + done.stderr
    assert "origin=prebuilt" in done.stdout
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing locked in the writable cache


def test_a_failed_build_is_one_line_and_the_eager_paths_serve(tmp_path: Path) -> None:
    done = load_in_child(LF_KERNELS_DIR=str(tmp_path), CXX="/bin/false", timeout_s=300)
    assert "native False False False" in done.stdout, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "native_kernels_unavailable" in line]
    assert len(lines) == 1 and "build failed" in lines[0]


def test_a_build_past_its_bound_is_killed_with_its_compilers(tmp_path: Path) -> None:
    """Compilers still running at the bound are gone when the build gives up: ninja runs each in a process
    group of its own, so killing the build's group alone left them compiling (or, here, held) on."""
    shim, cache = tmp_path / "cxx", tmp_path / "cache"
    shim.mkdir()
    held_compiler(shim)
    try:
        done = load_in_child(
            LF_KERNELS_DIR=str(cache), LF_KERNELS_BUILD_TIMEOUT_S="20", CXX=str(shim / "c++"), timeout_s=300
        )
        assert "native False False False" in done.stdout, done.stdout + done.stderr
        (line,) = [line for line in done.stdout.splitlines() if "native_kernels_unavailable" in line]
        assert "LF_KERNELS_BUILD_TIMEOUT_S" in line and "killed" in line
        assert (shim / "compiling").exists()  # the compilers had started: the case under test
        assert running_in(shim) == [] and running_in(cache) == []
    finally:
        for process in running_in(shim) + running_in(cache):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(process.name), signal.SIGKILL)


def _cmdline(process: Path) -> str:
    try:
        return (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # gone meanwhile
        return ""


def test_a_live_builder_is_waited_for_then_given_up(tmp_path: Path) -> None:
    """Another process holds the builders' flock (a build under way, perhaps in another container):
    status says so, and a start waits for it no longer than its bound."""
    name = native_build.extension_name()
    with (tmp_path / f"{name}.lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        status = kernels_cli("status", "--dir", tmp_path, timeout_s=120)
        assert status.returncode == 1 and "a build is under way" in status.stdout, status.stdout
        done = load_in_child(LF_KERNELS_DIR=str(tmp_path), LF_KERNELS_BUILD_TIMEOUT_S="2", timeout_s=300)
    assert "native False False False" in done.stdout, done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "native_kernels_unavailable" in line]
    assert "another process has been building" in line
    assert not (tmp_path / name / "build.log").exists()  # it never started a build of its own
