"""Where the native CPU kernels' library comes from, without ever blocking a start for long.

The library for this machine is named by :func:`extension_name` (a digest of the sources, the flags,
torch's version and this CPU's instruction sets) and lies at ``<dir>/<name>/<name>.so`` beside a
``build.json`` written after it (the mark of a complete build). :func:`library` looks in the
read-only prebuilt directories (``LF_KERNELS_PREBUILT``), then in the writable cache
(``LF_KERNELS_DIR``), and loads what it finds without a compiler. Otherwise it builds into the cache
in a child process (``python -m kernels.native_compile <build dir>``, torch's extension builder with
``MAX_JOBS`` compilers) bounded by ``LF_KERNELS_BUILD_TIMEOUT_S``: a build that fails or overruns is a
:class:`KernelBuildError`, and the engine keeps its eager paths.

Builders take an ``fcntl.flock`` on ``<dir>/<name>.lock``: the kernel releases it when its holder dies,
also across containers sharing the volume, so a killed build never blocks the next start. Holding
it, a ``lock`` file torch's builder left in the build folder is stale by definition (every builder
goes through the flock) and is removed: torch would wait on it forever.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

log = structlog.get_logger("kernels")

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_decode.cpp",
        "lora_bgmv.cpp",
        "layer_ops.cpp",
        "act_argmax.cpp",
        "small_gemm.cpp",
        "small_gemm_int8.cpp",
        "small_gemm_int4.cpp",
        "threads.cpp",
        "panel_gemm.cpp",
        "panel_dot_bf16.cpp",
        "panel_wide.cpp",
        "decoder_stack.cpp",
    )
)
HEADERS = tuple(CSRC / name for name in ("vec.h", "panel_run.h", "ahead.h"))
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-fopenmp"]
# -fopenmp links libgomp.so.1, the soname of torch's own bundled runtime, so the kernel's threads
# are torch's intra-op threads (torch.set_num_threads applies) rather than a second pool.
LDFLAGS = ["-fopenmp"]
RECORD = "build.json"  # written after the library: a build folder without it is incomplete
LOCK_POLL_S = 0.2

Origin = Literal["prebuilt", "cache", "built"]


class KernelSettings(BaseSettings):
    """Where the native kernels are looked for and built (``LF_KERNELS_*``), read where they are first used."""

    model_config = SettingsConfigDict(env_prefix="LF_KERNELS_", frozen=True, extra="ignore")

    dir: Path | None = Field(
        default=None,
        description="writable kernel cache the worker builds into; None = a lorafleet folder in torch's extensions "
        "directory (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py311_cpu)",
    )
    prebuilt: str = Field(
        default="",
        description="read-only directories searched first, separated by ':' (an image's `lorafleet kernels build "
        "--dir` output, e.g. /opt/lorafleet/kernels): a library built there for this CPU loads without a compiler",
    )
    build_timeout_s: float = Field(
        default=600.0, gt=0, le=86400, description="a build (or a wait for another's) past this is given up"
    )
    build_jobs: int = Field(
        default=2, ge=1, le=256, description="compilers a build runs at once (MAX_JOBS); each takes about 1.4 GB"
    )

    def cache_dir(self) -> Path:
        return self.dir if self.dir is not None else default_cache_dir()

    def search_dirs(self) -> list[Path]:
        """The prebuilt directories, then the cache: where a library is looked for, in order."""
        return [*(Path(p) for p in self.prebuilt.split(os.pathsep) if p), self.cache_dir()]


class KernelBuildError(Exception):
    """The native kernels are not available here: the build failed, overran its bound, or cannot run."""


@dataclass(frozen=True, slots=True)
class Library:
    path: Path  # the .so
    origin: Origin
    build_s: float  # how long this call's build took; 0 where it found one


def default_cache_dir() -> Path:
    """A ``lorafleet`` folder in torch's extensions directory (``TORCH_EXTENSIONS_DIR``, else torch's per-user
    cache folder for this Python and accelerator): a folder of its own, which a builder that takes no
    flock (an older lorafleet, torch's default build) never enters."""
    if explicit := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(explicit) / "lorafleet"
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}" / "lorafleet"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def extension_name() -> str:
    """The build's name: a digest of the sources and headers, the flags and this CPU's instruction-set
    flags (a changed header is a new build, never a stale one loaded)."""
    digest = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES + HEADERS),
        " ".join(CFLAGS + LDFLAGS).encode(),
        cpu_flags().encode(),
        torch.__version__.encode(),
    ):
        digest.update(part)
    return f"lorafleet_native_{digest.hexdigest()[:16]}"


def find(directory: Path, name: str) -> Path | None:
    """The complete library ``name`` in ``directory``, or None."""
    folder = directory / name
    library = folder / f"{name}.so"
    return library if (folder / RECORD).is_file() and library.is_file() else None


def record(directory: Path, name: str) -> dict[str, object] | None:
    """What ``build.json`` says of the build of ``name`` in ``directory``; None without one."""
    try:
        loaded: dict[str, object] = json.loads((directory / name / RECORD).read_text())
        return loaded
    except (OSError, ValueError):
        return None


def library(settings: KernelSettings | None = None) -> Library:
    """This machine's library: found in a searched directory, else built into the cache (waiting for
    another process's build of it first). Raises KernelBuildError."""
    settings = settings or KernelSettings()
    name = extension_name()
    *prebuilt, cache = settings.search_dirs()
    for directory in prebuilt:
        if found := find(directory, name):
            return Library(found, "prebuilt", 0.0)
    if found := find(cache, name):
        return Library(found, "cache", 0.0)
    return build(cache, name, settings)


def build(cache: Path, name: str, settings: KernelSettings) -> Library:
    """Build ``name`` into ``cache`` in a child process, under the builders' flock."""
    start = time.monotonic()
    deadline = start + settings.build_timeout_s
    try:
        (cache / name).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelBuildError(f"cannot create the kernel cache {cache / name}: {e}") from None
    with _builders_lock(cache / f"{name}.lock", deadline) as lock_fd:
        if found := find(cache, name):  # built by the process this one waited for
            return Library(found, "cache", 0.0)
        stale = cache / name / "lock"
        if stale.exists():
            stale.unlink(missing_ok=True)
            log.warning("native_kernels_stale_lock_removed", path=str(stale))
        _run_child(cache / name, settings.build_jobs, deadline - time.monotonic(), lock_fd)
        found = find(cache, name)
        if found is None:
            raise KernelBuildError(f"the build of {name} exited 0 but left no library in {cache / name}")
        return Library(found, "built", time.monotonic() - start)


def builder_active(cache: Path, name: str) -> bool:
    """Whether a process holds the builders' lock of ``name`` in ``cache`` now (a build is under way)."""
    path = cache / f"{name}.lock"
    if not path.exists():
        return False
    with path.open() as handle:  # read-only will do for flock (a prebuilt directory may be read-only)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@contextlib.contextmanager
def _builders_lock(path: Path, deadline: float) -> Iterator[int]:
    """Hold the exclusive flock on ``path``, waiting for another holder until ``deadline``; its descriptor."""
    try:
        handle = path.open("a")
    except OSError as e:  # a read-only cache: nothing can be built here
        raise KernelBuildError(f"cannot open the builders' lock {path}: {e}") from None
    with handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelBuildError(
                        f"another process has been building the native kernels ({path}) past the bound "
                        "(LF_KERNELS_BUILD_TIMEOUT_S)"
                    ) from None
                time.sleep(LOCK_POLL_S)  # flock has no timed wait; its holder may be in another container
        try:
            yield handle.fileno()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


SESSION_EXIT_S = 10.0  # how long a killed build's processes may take to go (well under, even a linker's)


def _kill_session(session: int, timeout_s: float) -> None:
    """SIGKILL every process of ``session`` (the build child's: ninja runs each compiler in a process group
    of its own, so killing the child's group leaves them running) until none is left alive, at most
    ``timeout_s``: a kill is delivered when the process is next scheduled, and one may fork meanwhile."""
    deadline = time.monotonic() + timeout_s
    while (alive := _in_session(session)) and time.monotonic() < deadline:
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def _in_session(session: int) -> list[int]:
    """The live processes (not zombies) of ``session``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp session ...
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            found.append(int(stat.parent.name))
    return found


def _run_child(folder: Path, jobs: int, timeout_s: float, lock_fd: int) -> None:
    """``python -m kernels.native_compile <folder>`` in its own process group (killed whole on overrun),
    its output in ``<folder>/build.log``. The child shares the builders' flock: a builder killed alone
    leaves its build running to the end, and nobody starts another in the same folder meanwhile."""
    env = dict(os.environ, MAX_JOBS=str(jobs))
    # the child imports this very kernels/ package (not another checkout's or install's)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH"))))
    if shutil.which("ninja", path=env.get("PATH")) is None:
        # torch's builder runs ``ninja`` from PATH: the ``ninja`` wheel's binary (a dependency, in the
        # environment's bin directory, which a bare ``.venv/bin/python`` leaves off PATH)
        import ninja

        env["PATH"] = os.pathsep.join(filter(None, (ninja.BIN_DIR, env.get("PATH"))))
    output = folder / "build.log"
    with output.open("w") as out:
        child = subprocess.Popen(
            [sys.executable, "-m", "kernels.native_compile", str(folder)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=(lock_fd,),
        )
        try:
            code = child.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the builder and ninja
            _kill_session(child.pid, SESSION_EXIT_S)  # and the compilers, each in a process group of its own
            child.wait()
            raise KernelBuildError(
                f"the native kernels' build ran past {timeout_s:.0f} s (LF_KERNELS_BUILD_TIMEOUT_S) and was killed"
            ) from None
    if code != 0:
        tail = output.read_text(errors="replace")[-1500:].strip()
        raise KernelBuildError(f"the native kernels' build failed (exit {code}; {output}): {tail}")
