"""Whether this machine can build kernels/native.py's CPU kernels: where it can, a failed build fails
the tests that use them; where it cannot (no x86-64 g++), they are skipped and the eager paths serve."""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

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


def linear_case(
    rows: int, out: int, inp: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A projection's x [rows, inp], weight [out, inp] (scaled by 1 / sqrt(inp)) and bias [out] or None,
    seeded by the shape."""
    g = torch.Generator().manual_seed(rows * 131 + out + inp)
    x = torch.randn(rows, inp, generator=g).to(dtype)
    weight = (torch.randn(out, inp, generator=g) / inp**0.5).to(dtype)
    return x, weight, torch.randn(out, generator=g).to(dtype) if bias else None


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in fp32 on the (exactly widened) inputs: what a kernel's fp32 sum should be."""
    return torch.nn.functional.linear(x.float(), weight.float(), bias.float() if bias is not None else None)


def child_report(code: str) -> dict:
    """Run ``code`` in a child Python at the repository root on two intra-op threads (torch's thread
    counts are process-wide state) and return the JSON object its last line of output prints."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "2"}, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return report
