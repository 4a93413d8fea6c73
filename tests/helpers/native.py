"""Whether this machine can build kernels/native.py's CPU kernels: where it can, a failed build fails
the tests that use them; where it cannot (no x86-64 g++), they are skipped and the eager paths serve."""

import platform
import shutil

import pytest
import torch

TOOLCHAIN = platform.machine() == "x86_64" and shutil.which("g++") is not None
needs_toolchain = pytest.mark.skipif(not TOOLCHAIN, reason="no x86-64 g++ here: the eager paths serve")


def record_rows(monkeypatch: pytest.MonkeyPatch, op: str) -> list[int]:
    """Wraps the torch op at the dotted path ``op`` (``torch.ops.<namespace>.<name>``) so every call
    still runs it and appends its input's row count to the returned list."""
    namespace, name = op.removeprefix("torch.ops.").split(".")
    real = getattr(getattr(torch.ops, namespace), name)
    rows: list[int] = []

    def spy(x: torch.Tensor, *args):
        rows.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(op, spy)
    return rows
