"""The fp32 sixteen-lane panel kernel (kernels/projections.py ``panel_pack_wide`` +
``panel_linear_wide``: the weight packed once into 32-feature panels, an 8 x 32 register tile of
AVX-512 FMAs) against the exact sum: row counts around its tile, odd and deep inputs, a bias or none,
widths that are not multiples of a panel or of a vector; strided inputs; its result does not depend
on the thread count; what it refuses; and that the engine's fp32 linears take it past the small rows.
Built only where the CPU has AVX-512: elsewhere it must say so, and these tests are skipped."""

from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.projections import native_panel_wide, panel_linear_wide, panel_pack_wide
from services.worker.engine.linear import LinearFactory, small_rows
from tests.helpers.native import exact_linear as _exact
from tests.helpers.native import linear_case as _case
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain
needs_wide = pytest.mark.skipif(
    not (native.built() and torch.ops.lorafleet.panel_wide_avx512()), reason="this CPU has no AVX-512"
)


def _wide(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return panel_linear_wide(x, panel_pack_wide(weight), bias, weight.shape[0])


def test_it_is_built_exactly_where_the_cpu_has_avx512() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    assert native.built()
    assert torch.ops.lorafleet.panel_wide_avx512() == ("avx512f" in flags)
    assert native_panel_wide() == torch.ops.lorafleet.panel_wide_avx512()  # and where built, its probe passes


@pytest.mark.skipif(native.built() and torch.ops.lorafleet.panel_wide_avx512(), reason="this build has AVX-512")
def test_a_build_without_it_refuses_rather_than_computing() -> None:
    x, weight, _ = _case(3, 40, 16, torch.float32, False)
    with pytest.raises(RuntimeError, match="no AVX-512"):
        _wide(x, weight, None)


@needs_wide
def test_the_packed_layout_is_32_feature_panels_zero_padded() -> None:
    weight = torch.randn(40, 7)
    packed = panel_pack_wide(weight)
    assert packed.shape == (2, 7, 32) and packed.dtype == torch.float32
    for p in range(2):
        features = weight[32 * p : 32 * (p + 1)]
        assert torch.equal(packed[p, :, : features.shape[0]], features.t())
    assert not packed[1, :, 8:].any()  # past the last feature


# rows: the 8-row tile and its remainders; shapes: whole panels, a half vector, one vector and a bit,
# one feature, one input, deep inputs, many panels
@needs_wide
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 32, 133])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (32, 8), (8, 9), (17, 5), (1, 16), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_it_is_the_fp32_sum(rows: int, shape: tuple[int, int], bias: bool) -> None:
    x, weight, b = _case(rows, *shape, torch.float32, bias)
    got = _wide(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got, _exact(x, weight, b), rtol=1e-5, atol=1e-5)


@needs_wide
def test_it_writes_only_its_own_features() -> None:
    """The last panel's masked stores: nothing past ``features`` in a row, so the rows of the output
    (a new [rows, features] tensor) are each exactly their own sums."""
    x, weight, b = _case(11, 45, 20, torch.float32, True)
    got = _wide(x, weight, b)
    for row in range(11):
        torch.testing.assert_close(got[row], _exact(x[row : row + 1], weight, b)[0], rtol=1e-5, atol=1e-5)


@needs_wide
def test_strided_and_transposed_inputs() -> None:
    """x as a column slice of a wider tensor (read in place), or transposed (copied to rows first)."""
    wide, weight, b = _case(9, 96, 100, torch.float32, True)
    w = weight[:, :80].contiguous()
    for x in (wide[:, 10:90], wide[:, 11:91], wide[:, :80].t().contiguous().t()):
        torch.testing.assert_close(_wide(x, w, b), _exact(x, w, b), rtol=1e-5, atol=1e-5)


@needs_wide
def test_the_result_does_not_depend_on_the_thread_count() -> None:
    x, weight, b = _case(37, 1000, 300, torch.float32, True)
    packed = panel_pack_wide(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(panel_linear_wide(x, packed, b, 1000))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@needs_wide
def test_it_refuses_what_it_cannot_compute() -> None:
    x, weight, b = _case(3, 40, 8, torch.float32, True)
    packed = panel_pack_wide(weight)
    assert _wide(torch.empty(0, 8), weight, b).shape == (0, 40)
    with pytest.raises(RuntimeError, match="features, the weight"):
        panel_linear_wide(x[:, :5], packed, b, 40)
    with pytest.raises(RuntimeError, match="do not fit"):
        panel_linear_wide(x, packed, None, 65)
    with pytest.raises(RuntimeError, match="fp32 only"):
        panel_linear_wide(x.bfloat16(), packed, b, 40)
    with pytest.raises(RuntimeError, match="fp32 only"):
        panel_pack_wide(weight.bfloat16())
    with pytest.raises(RuntimeError, match="bias"):
        panel_linear_wide(x, packed, b[:8], 40)
    with pytest.raises(RuntimeError, match="panel_pack_wide"):
        panel_linear_wide(x, weight, b, 40)  # a plain weight, not packed
    with pytest.raises(RuntimeError, match="contiguous"):
        panel_linear_wide(x, packed.transpose(0, 1).contiguous().transpose(0, 1), None, 40)


@needs_wide
def test_fp32_linears_take_it_past_the_small_rows_and_bf16_ones_do_not(monkeypatch: pytest.MonkeyPatch) -> None:
    _, weight, b = _case(1, 64, 32, torch.float32, True)
    linear = LinearFactory("auto", "cpu", torch.float32)(weight, b)
    assert linear.path == "wide" and linear.prepared is not None  # its panels, and no oneDNN copy besides
    wide = record_rows(monkeypatch, "torch.ops.lorafleet.panel_linear_wide")
    small = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    served = small_rows(torch.float32, "wide")
    assert linear.small_rows == served == 4
    for rows in (1, served, served + 1, 40, 300):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(linear(x), _exact(x, weight, b), rtol=1e-5, atol=1e-5)
    assert small == [1, served] and wide == [served + 1, 40, 300]
    assert LinearFactory("auto", "cpu", torch.bfloat16)(weight.bfloat16()).path != "wide"
    assert LinearFactory("torch", "cpu", torch.float32)(weight).path == "torch"
    assert LinearFactory("onednn", "cpu", torch.float32)(weight).path == "onednn"
    forced = LinearFactory("panel", "cpu", torch.float32)(weight)
    assert forced.path == "wide" and forced.small_rows == 0
