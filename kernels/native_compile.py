"""The child process of kernels/native_build.py's build: ``python -m kernels.native_compile <build folder>``
compiles and links this machine's library there with torch's extension builder (``MAX_JOBS``
compilers), loads it once, then writes the folder's ``build.json``."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from kernels.native_build import CFLAGS, HEADERS, LDFLAGS, RECORD, SOURCES, KernelBuildError, extension_name

STAGED = "src"  # compiled from a copy in the build folder: one ninja command line whatever checkout calls


def stage_sources(folder: Path) -> list[Path]:
    """Copy the sources and headers into ``folder/src`` (a file only where it differs, so ninja sees
    unchanged ones as built); the staged sources."""
    staged = folder / STAGED
    staged.mkdir(exist_ok=True)
    for source in SOURCES + HEADERS:
        target = staged / source.name
        if not target.is_file() or target.read_bytes() != source.read_bytes():
            shutil.copyfile(source, target)
    return [staged / source.name for source in SOURCES]


def compile_into(folder: Path) -> None:
    name = extension_name()
    if folder.name != name:
        raise KernelBuildError(f"{folder} is not the build folder of this machine's {name}")
    start = time.monotonic()
    load(
        name=name,
        sources=[str(s) for s in stage_sources(folder)],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(folder),
        is_python_module=False,
    )
    entry = {
        "name": name,
        "torch": torch.__version__,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": round(time.monotonic() - start, 1),
        "jobs": os.environ.get("MAX_JOBS", ""),
    }
    temporary = folder / f"{RECORD}.tmp"
    temporary.write_text(json.dumps(entry))
    temporary.replace(folder / RECORD)  # last: the mark of a complete build


if __name__ == "__main__":
    compile_into(Path(sys.argv[1]))
