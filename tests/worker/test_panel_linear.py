"""The native panel projection kernel (kernels/native.py ``panel_linear``: bf16 weights widened to
fp32 panels under an FMA kernel, for CPUs where oneDNN has no bf16 GEMM) against ``F.linear``: row
counts around its five-row tile, both dtypes, a bias or none, widths that are not multiples of its
sixteen-feature panel or eight-element transpose; its rounding is torch's; what it refuses; and
which rows the engine's linears send to it."""

import pytest
import torch
import torch.nn.functional as F

from kernels.native import native_panel_linear, panel_linear
from services.worker.engine import linear as linear_module
from services.worker.engine.linear import LinearFactory, onednn_usable, small_rows
from tests.helpers.native import exact_linear as _exact
from tests.helpers.native import linear_case as _case
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain


def test_it_builds_and_passes_its_probe() -> None:
    assert native_panel_linear()


@pytest.mark.parametrize("rows", [1, 4, 5, 6, 11, 32, 133])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (16, 8), (17, 9), (1, 16), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_f_linear(rows: int, shape: tuple[int, int], bias: bool) -> None:
    x, weight, b = _case(rows, *shape, torch.float32, bias)
    torch.testing.assert_close(panel_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 7, 32, 133])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (33, 70), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_fp32_sum_rounded_once(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """bf16 inputs widen exactly; the only rounding is the result's (at most half a bf16 ulp, 2^-9
    relative), as a bf16 GEMM with an fp32 accumulator rounds it."""
    x, weight, b = _case(rows, *shape, torch.bfloat16, bias)
    got = panel_linear(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.float(), _exact(x, weight, b), rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("out", [16, 21])  # full panels take the vector rounding, a partial one the scalar
def test_bf16_rounding_is_torchs_bit_for_bit(out: int) -> None:
    """With an identity weight each output is x + bias, an exact fp32 sum of two bf16 values, so the
    kernel's rounding of it must be torch's to the bit (NaN: a NaN): ties to even, overflow to inf, inf kept."""
    g = torch.Generator().manual_seed(out)
    x = torch.randn(40, out, generator=g).bfloat16()
    bias = (torch.randn(out, generator=g) * 2**-8).bfloat16()  # sums that need rounding, ties among them
    bias[0], bias[2] = float("nan"), float("-inf")
    bias[1], x[3, 1] = 2.0**119, torch.finfo(torch.bfloat16).max  # max + half its ulp: a tie, to inf
    got = panel_linear(x, torch.eye(out).bfloat16(), bias)
    want = (x.float() + bias.float()).bfloat16()
    numbers = ~want.isnan()  # a NaN's bits differ between torch's own scalar and vector conversions
    assert torch.equal(got.view(torch.int16)[numbers], want.view(torch.int16)[numbers])
    assert (
        torch.equal(got.isnan(), want.isnan())
        and got[:, 0].isnan().all()
        and (got[:, 2] == float("-inf")).all()
        and got[3, 1] == float("inf")
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_and_transposed_inputs(dtype: torch.dtype) -> None:
    """x as a column slice of a wider tensor (read in place) or transposed (copied to rows first)."""
    wide, weight, b = _case(9, 96, 100, dtype, True)
    w = weight[:, :80].contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8
    for x in (wide[:, 10:90], wide[:, :80].t().contiguous().t()):
        torch.testing.assert_close(panel_linear(x, w, b).float(), _exact(x, w, b), rtol=tolerance, atol=1e-5)


def test_zero_rows_give_an_empty_output() -> None:
    _, weight, b = _case(1, 24, 8, torch.bfloat16, True)
    assert panel_linear(torch.empty(0, 8, dtype=torch.bfloat16), weight, b).shape == (0, 24)


def test_it_refuses_what_it_cannot_compute() -> None:
    x, weight, b = _case(3, 16, 8, torch.float32, True)
    with pytest.raises(RuntimeError, match="features"):
        panel_linear(x, weight[:, :7].contiguous(), b)
    with pytest.raises(RuntimeError, match="dtype"):
        panel_linear(x.bfloat16(), weight, b)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        panel_linear(x.half(), weight.half(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        panel_linear(x, weight.t().contiguous().t(), None)
    with pytest.raises(RuntimeError, match="bias"):
        panel_linear(x, weight, b[:8])
    with pytest.raises(RuntimeError, match="x \\[rows, in\\]"):
        panel_linear(x[0], weight, b)


@pytest.fixture
def no_onednn_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU as one where oneDNN has no bf16 GEMM (any CPU without AVX-512, the AMD EPYC CI
    machines among them), whatever this one has."""
    real = onednn_usable
    monkeypatch.setattr(linear_module, "onednn_usable", lambda dtype: False if dtype == torch.bfloat16 else real(dtype))


def test_auto_sends_bf16_past_the_small_rows_to_the_panel_kernel_where_onednn_has_no_bf16(
    monkeypatch: pytest.MonkeyPatch, no_onednn_bf16: None
) -> None:
    _, weight, b = _case(1, 64, 32, torch.bfloat16, True)
    linear = LinearFactory("auto", "cpu", torch.bfloat16)(weight, b)
    assert linear.packed is None and linear.panel
    panel = record_rows(monkeypatch, "torch.ops.lorafleet.panel_linear")
    small = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    served = small_rows(torch.bfloat16)
    for rows in (1, served, served + 1, 40, 300):
        x = torch.randn(rows, 32).bfloat16()
        got = linear(x)
        assert got.shape == (rows, 64) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), _exact(x, weight, b), rtol=2**-7, atol=2**-7)
    assert small == [1, served] and panel == [served + 1, 40, 300]


def test_where_onednn_has_bf16_or_for_fp32_or_in_torch_mode_the_panel_kernel_is_not_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, weight, _ = _case(1, 64, 32, torch.float32, False)
    assert not LinearFactory("auto", "cpu", torch.float32)(weight).panel
    assert not LinearFactory("torch", "cpu", torch.bfloat16)(weight.bfloat16()).panel
    monkeypatch.setattr(linear_module, "onednn_usable", lambda dtype: True)  # a CPU with oneDNN bf16:
    monkeypatch.setattr(linear_module, "_pack", lambda weight: weight)  # (this one may lack it to pack)
    assert not LinearFactory("auto", "cpu", torch.bfloat16)(weight.bfloat16()).panel


def test_bf16_without_onednn_or_the_kernel_warns_at_load(monkeypatch: pytest.MonkeyPatch, no_onednn_bf16: None) -> None:
    """Where neither oneDNN nor the native kernel has a bf16 GEMM, bf16 is still served (on torch's
    reference GEMM) and the load says so."""
    events: list[str] = []
    monkeypatch.setattr(linear_module.native, "native_panel_linear", lambda: False)
    monkeypatch.setattr(linear_module.log, "warning", lambda event, **_: events.append(event))
    _, weight, _ = _case(1, 64, 32, torch.bfloat16, False)
    linear = LinearFactory("auto", "cpu", torch.bfloat16)(weight)
    assert not linear.panel and events == ["bf16_linear_reference_gemm"]
    torch.testing.assert_close(
        linear(torch.ones(9, 32).bfloat16()).float(), _exact(torch.ones(9, 32), weight, None), rtol=2**-7, atol=2**-7
    )
