"""The native small-row projection kernel (kernels/projections.py ``small_linear``) against ``F.linear``:
every row count it takes, both dtypes, a bias or none, widths that are not a multiple of the vector
width, strided input rows; what it refuses; and which rows the engine's linears send to it."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import projections
from kernels.projections import (
    SMALL_LINEAR_ROWS,
    amx_bf16,
    native_small_linear,
    small_linear,
    small_linear_dot_bf16,
)
from services.worker.engine.linear import (
    AMX_SMALL_ROWS,
    BF16_WIDENING_ROWS,
    PANEL_SMALL_ROWS,
    LinearFactory,
    onednn_usable,
    small_rows,
)
from tests.helpers.native import exact_linear as _exact
from tests.helpers.native import linear_case as _case
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain


def test_it_builds_and_passes_its_probe() -> None:
    assert native_small_linear()


@pytest.mark.parametrize("rows", range(1, SMALL_LINEAR_ROWS + 1))
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (1, 16), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_f_linear(rows: int, shape: tuple[int, int], bias: bool) -> None:
    x, weight, b = _case(rows, *shape, torch.float32, bias)
    torch.testing.assert_close(small_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])  # 4 and up: vdpbf16ps where the CPU has AVX512-BF16
@pytest.mark.parametrize("shape", [(960, 576), (49, 37), (33, 70), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_fp32_sum_rounded_once(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """bf16 inputs widen exactly; the only rounding is the result's (at most half a bf16 ulp, 2^-9
    relative), where F.linear's oneDNN bf16 matmul rounds its fp32 accumulator the same way."""
    x, weight, b = _case(rows, *shape, torch.bfloat16, bias)
    got = small_linear(x, weight, b)
    assert got.dtype == torch.bfloat16
    exact = _exact(x, weight, b)
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(got.float(), F.linear(x, weight, b).float(), rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows_are_read_in_place(dtype: torch.dtype) -> None:
    """x as a column slice of a wider tensor (contiguous rows, a row stride past its width)."""
    wide, weight, b = _case(4, 96, 100, dtype, True)
    x = wide[:, 10:90]
    w = weight[:, :80].contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(small_linear(x, w, b).float(), _exact(x, w, b), rtol=tolerance, atol=1e-5)


def test_bf16_takes_eight_rows_where_the_cpu_has_the_bf16_dot_product_or_no_onednn_bf16() -> None:
    """The build compiles vdpbf16ps wherever this CPU has AVX512-BF16 (-march=native). auto sends bf16
    batches past four rows to the kernel there, and where oneDNN has no bf16 GEMM at all (AVX2: the
    alternative is the slower panel kernel); it stops at four rows only against oneDNN's bf16 path, and
    at seven against oneDNN's AMX tiles."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    assert small_linear_dot_bf16() == ("avx512_bf16" in flags)
    assert amx_bf16() == ("amx_bf16" in flags)
    expected = SMALL_LINEAR_ROWS if small_linear_dot_bf16() else BF16_WIDENING_ROWS
    if amx_bf16() and onednn_usable(torch.bfloat16):
        expected = AMX_SMALL_ROWS
    assert small_rows(torch.bfloat16, "onednn") == expected
    assert small_rows(torch.bfloat16, "torch") == SMALL_LINEAR_ROWS  # against torch's reference GEMM
    assert small_rows(torch.float32, "onednn") == SMALL_LINEAR_ROWS and small_rows(torch.float16, "onednn") == 0
    # against the eight-lane panel kernel (AVX2) four rows in either dtype, the sixteen-lane fp32 one
    # four, the bf16 dot-product one one
    assert small_rows(torch.float32, "eight") == small_rows(torch.bfloat16, "eight") == PANEL_SMALL_ROWS
    assert small_rows(torch.float32, "wide") == PANEL_SMALL_ROWS and small_rows(torch.bfloat16, "dot") == 1
    assert small_rows(torch.float16, "eight") == 0


def test_it_refuses_what_it_cannot_compute() -> None:
    x, weight, b = _case(SMALL_LINEAR_ROWS + 1, 16, 8, torch.float32, True)
    with pytest.raises(RuntimeError, match="rows"):
        small_linear(x, weight, b)
    with pytest.raises(RuntimeError, match="features"):
        small_linear(x[:2], weight[:, :7].contiguous(), b)
    with pytest.raises(RuntimeError, match="dtype"):
        small_linear(x[:2].bfloat16(), weight, b)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        small_linear(x[:2].half(), weight.half(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        small_linear(x[:2], weight.t().contiguous().t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        small_linear(x[:2], weight, b[:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_sends_small_rows_to_the_kernel_and_the_rest_past_it(monkeypatch, dtype: torch.dtype) -> None:
    """(bf16 on a CPU without the dot-product panel kernel, which takes every bf16 row where it is.)"""
    monkeypatch.setattr(projections, "native_panel_dot", lambda: False)
    x, weight, _ = _case(1, 64, 32, dtype, False)
    linear = LinearFactory("auto", "cpu", dtype)(weight)
    rows_served = small_rows(dtype, linear.path)
    assert linear.small_rows == rows_served > 0
    small = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    for rows in (1, rows_served, rows_served + 1, 40):
        x = torch.randn(rows, 32).to(dtype)
        got = linear(x)
        assert got.shape == (rows, 64) and got.dtype == dtype
        torch.testing.assert_close(got.float(), _exact(x, weight, None), rtol=tolerance, atol=tolerance)
    assert small == [1, rows_served]  # more rows: the panel kernel or oneDNN's packed path


def test_torch_and_onednn_modes_never_take_the_kernel() -> None:
    _, weight, _ = _case(1, 64, 32, torch.float32, False)
    assert LinearFactory("torch", "cpu", torch.float32)(weight).small_rows == 0
    assert LinearFactory("onednn", "cpu", torch.float32)(weight).small_rows == 0
    assert LinearFactory("auto", "cpu", torch.float16)(weight.half()).small_rows == 0
