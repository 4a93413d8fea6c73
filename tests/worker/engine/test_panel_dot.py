"""The bf16 dot-product panel kernel (kernels/projections.py ``panel_pack_dot`` + ``panel_linear_dot``: the
weight packed once into 32-feature panels of input pairs, an 8 x 32 register tile of AVX512-BF16
vdpbf16ps) against the exact fp32 sum: row counts around its tile, odd and deep inputs, a bias or
none, widths that are not multiples of a panel; its rounding is torch's; its result does not depend
on the thread count; what it refuses; and that the engine's bf16 linears take it past the small rows.
Built only where the CPU has AVX512-BF16: elsewhere it must say so, and these tests are skipped."""

from pathlib import Path

import pytest
import torch

from kernels import native, projections
from kernels.projections import native_panel_dot, panel_linear_dot, panel_pack_dot
from services.worker.engine.linear import AMX_SMALL_ROWS, LinearFactory, onednn_usable, small_rows
from tests.helpers.native import exact_linear as _exact
from tests.helpers.native import linear_case as _case
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain
needs_bf16_dot = pytest.mark.skipif(
    not (native.built() and torch.ops.lorafleet.panel_dot_bf16()), reason="this CPU has no AVX512-BF16"
)


def _dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return panel_linear_dot(x, panel_pack_dot(weight), bias, weight.shape[0])


def test_it_is_built_exactly_where_the_cpu_has_avx512_bf16() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    assert native.built()
    assert torch.ops.lorafleet.panel_dot_bf16() == ("avx512_bf16" in flags and "avx512f" in flags)
    assert native_panel_dot() == torch.ops.lorafleet.panel_dot_bf16()  # and where built, its probe passes


@pytest.mark.skipif(
    native.built() and torch.ops.lorafleet.panel_dot_bf16(), reason="this build has AVX512-BF16: it computes"
)
def test_a_build_without_it_refuses_rather_than_computing() -> None:
    x, weight, _ = _case(3, 40, 16, torch.bfloat16, False)
    with pytest.raises(RuntimeError, match="no AVX512-BF16"):
        _dot(x, weight, None)


@needs_bf16_dot
def test_the_packed_layout_is_32_feature_panels_of_input_pairs_zero_padded() -> None:
    weight = torch.randn(40, 7).bfloat16()
    packed = panel_pack_dot(weight)
    assert packed.shape == (2, 4, 32, 2) and packed.dtype == torch.bfloat16
    for p in range(2):
        features = weight[32 * p : 32 * (p + 1)]
        for k in range(7):
            assert torch.equal(packed[p, k // 2, : features.shape[0], k % 2], features[:, k])
    assert not packed[1, :, 8:].any() and not packed[:, 3, :, 1].any()  # past the features; past the odd input


# rows: the 8-row tile and its remainders; in: even, odd, one, deep
@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32, 133])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (32, 8), (33, 9), (1, 16), (130, 1), (40, 3001)])
@pytest.mark.parametrize("bias", [False, True])
def test_it_is_the_fp32_sum_rounded_once(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """bf16 products are exact in fp32; the sum's order and the result's rounding (half a bf16 ulp)
    are the only differences from the exact fp32 sum."""
    x, weight, b = _case(rows, *shape, torch.bfloat16, bias)
    got = _dot(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.float(), _exact(x, weight, b), rtol=2**-8, atol=1e-4)


@needs_bf16_dot
def test_rounding_is_torchs_bit_for_bit() -> None:
    """With an identity weight each output is x + bias, an exact fp32 sum of two bf16 values, so the
    kernel's rounding of it must be torch's to the bit: ties to even, overflow to inf, inf and NaN kept."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 35, generator=g).bfloat16()
    bias = (torch.randn(35, generator=g) * 2**-8).bfloat16()
    bias[0], bias[2] = float("nan"), float("-inf")
    bias[1], x[3, 1] = 2.0**119, torch.finfo(torch.bfloat16).max
    got = _dot(x, torch.eye(35).bfloat16(), bias)
    want = (x.float() + bias.float()).bfloat16()
    numbers = ~want.isnan()
    assert torch.equal(got.view(torch.int16)[numbers], want.view(torch.int16)[numbers])
    assert got[:, 0].isnan().all() and (got[:, 2] == float("-inf")).all() and got[3, 1] == float("inf")


@needs_bf16_dot
def test_strided_odd_and_transposed_inputs() -> None:
    """x as a column slice of a wider tensor (read in place where its pairs are aligned, else copied),
    or transposed (copied to rows first)."""
    wide, weight, b = _case(9, 96, 100, torch.bfloat16, True)
    w = weight[:, :80].contiguous()
    for x in (wide[:, 10:90], wide[:, 11:91], wide[:, :80].t().contiguous().t()):
        torch.testing.assert_close(_dot(x, w, b).float(), _exact(x, w, b), rtol=2**-8, atol=1e-4)


@needs_bf16_dot
def test_the_result_does_not_depend_on_the_thread_count() -> None:
    x, weight, b = _case(37, 1000, 300, torch.bfloat16, True)
    packed = panel_pack_dot(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(panel_linear_dot(x, packed, b, 1000))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@needs_bf16_dot
def test_it_refuses_what_it_cannot_compute() -> None:
    x, weight, b = _case(3, 40, 8, torch.bfloat16, True)
    packed = panel_pack_dot(weight)
    assert _dot(torch.empty(0, 8, dtype=torch.bfloat16), weight, b).shape == (0, 40)
    with pytest.raises(RuntimeError, match="pairs"):
        panel_linear_dot(x[:, :5], packed, b, 40)
    with pytest.raises(RuntimeError, match="do not fit"):
        panel_linear_dot(x, packed, None, 65)
    with pytest.raises(RuntimeError, match="bf16 only"):
        panel_linear_dot(x.float(), packed, b, 40)
    with pytest.raises(RuntimeError, match="bf16 only"):
        panel_pack_dot(weight.float())
    with pytest.raises(RuntimeError, match="bias"):
        panel_linear_dot(x, packed, b[:8], 40)
    with pytest.raises(RuntimeError, match="panel_pack_dot"):
        panel_linear_dot(x, weight, b, 40)  # a plain weight, not packed
    with pytest.raises(RuntimeError, match="contiguous"):
        panel_linear_dot(x, packed.transpose(0, 1).contiguous().transpose(0, 1), None, 40)


@needs_bf16_dot
def test_bf16_linears_take_it_past_one_row_and_fp32_ones_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projections, "amx_bf16", lambda: False)  # a CPU without AMX (Zen 4)
    _, weight, b = _case(1, 64, 32, torch.bfloat16, True)
    linear = LinearFactory("auto", "cpu", torch.bfloat16)(weight, b)
    assert linear.path == "dot" and linear.prepared is not None  # its panels, and no oneDNN copy besides
    assert linear.small_rows == small_rows(torch.bfloat16, "dot") == 1  # it beats the small-row kernel at 2-8 rows
    dot = record_rows(monkeypatch, "torch.ops.lorafleet.panel_linear_dot")
    small = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    for rows in (1, 2, 4, 8, 9, 40, 300):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(linear(x).float(), _exact(x, weight, b), rtol=2**-7, atol=2**-7)
    assert small == [1] and dot == [2, 4, 8, 9, 40, 300]
    assert LinearFactory("auto", "cpu", torch.float32)(weight.float()).path != "dot"
    assert LinearFactory("torch", "cpu", torch.bfloat16)(weight).path == "torch"
    assert LinearFactory("panel", "cpu", torch.bfloat16)(weight).path == "dot"


@needs_bf16_dot
@pytest.mark.skipif(not onednn_usable(torch.bfloat16), reason="no oneDNN bf16 GEMM on this CPU")
def test_bf16_linears_on_amx_take_onednn_past_the_small_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX, ``auto`` bf16: the small-row kernel up to AMX_SMALL_ROWS, oneDNN's packed linear (its
    tile GEMM) past them, rows padded; no dot-product panel copy. ``panel`` still takes the dot kernel."""
    monkeypatch.setattr(projections, "amx_bf16", lambda: True)
    _, weight, b = _case(1, 64, 32, torch.bfloat16, True)
    linear = LinearFactory("auto", "cpu", torch.bfloat16)(weight, b)
    assert linear.path == "onednn" and linear.small_rows == AMX_SMALL_ROWS == 7
    small = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    onednn = record_rows(monkeypatch, "torch.ops.mkldnn._linear_pointwise")
    for rows in (1, 7, 8, 9, 40, 300):
        x = torch.randn(rows, 32).bfloat16()
        torch.testing.assert_close(linear(x).float(), _exact(x, weight, b), rtol=2**-7, atol=2**-7)
    assert small == [1, 7] and onednn == [8, 16, 40, 320]  # padded_rows
    assert LinearFactory("panel", "cpu", torch.bfloat16)(weight).path == "dot"
    assert LinearFactory("auto", "cpu", torch.float32)(weight.float()).path == "wide"
