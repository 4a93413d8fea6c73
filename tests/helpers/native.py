"""Whether this machine can build kernels/native.py's CPU kernels: where it can, a failed build fails
the tests that use them; where it cannot (no x86-64 g++), they are skipped and the eager paths serve."""

import platform
import shutil

import pytest

TOOLCHAIN = platform.machine() == "x86_64" and shutil.which("g++") is not None
needs_toolchain = pytest.mark.skipif(not TOOLCHAIN, reason="no x86-64 g++ here: the eager paths serve")
