"""The native panel projection kernel (kernels/projections.py ``panel_pack`` + ``panel_linear``: the weight
packed once into 24-feature panels, a 4 x 24 FMA register tile) against ``F.linear``: row counts around
its tile and its row blocks, depths around its k blocks, both dtypes, a bias or none, widths that are
not multiples of a panel; its rounding is torch's; its result does not depend on the thread count;
what it refuses; and which rows the engine's linears send to it."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import projections
from kernels.projections import native_panel_linear, panel_linear, panel_linear_preferred, panel_pack
from services.worker.engine import linear as linear_module
from services.worker.engine.linear import LinearFactory, onednn_usable, small_rows
from tests.helpers.native import exact_linear as _exact
from tests.helpers.native import linear_case as _case
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain


def _panel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return panel_linear(x, panel_pack(weight), bias, weight.shape[0])


def test_it_builds_and_passes_its_probe() -> None:
    assert native_panel_linear()


def test_it_is_preferred_over_onednn_exactly_on_cpus_without_avx512() -> None:
    flags = Path("/proc/cpuinfo").read_text().split()
    assert panel_linear_preferred() == (torch.ops.lorafleet.panel_avx2() and "avx512f" not in flags)


def test_the_packed_layout_is_24_feature_panels_zero_padded() -> None:
    weight = torch.randn(50, 7)
    packed = panel_pack(weight)
    assert packed.shape == (3, 7, 24) and packed.dtype == torch.float32
    for p in range(3):
        features = weight[24 * p : 24 * (p + 1)]
        assert torch.equal(packed[p, :, : features.shape[0]], features.t())
    assert not packed[2, :, 2:].any()
    assert panel_pack(weight.bfloat16()).dtype == torch.bfloat16


# rows: one tile and its remainders, row blocks (112 rows at in=576, 40 at 1536, 4 at 70000); in:
# one k block, several and a partial one (256 k each)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 32, 133])
@pytest.mark.parametrize(
    "shape", [(960, 576), (576, 1536), (49, 37), (24, 8), (25, 9), (1, 16), (130, 1), (48, 700), (23, 257)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_f_linear(rows: int, shape: tuple[int, int], bias: bool) -> None:
    x, weight, b = _case(rows, *shape, torch.float32, bias)
    torch.testing.assert_close(_panel(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_rows_past_many_row_blocks() -> None:
    """A deep input leaves a row block of four rows: 9 blocks, the last partial."""
    x, weight, b = _case(35, 30, 70000, torch.float32, True)
    torch.testing.assert_close(_panel(x, weight, b), _exact(x, weight, b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 7, 32, 133])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (33, 70), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_fp32_sum_rounded_once(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """bf16 inputs widen exactly; the only rounding is the result's (at most half a bf16 ulp, 2^-9
    relative), as a bf16 GEMM with an fp32 accumulator rounds it."""
    x, weight, b = _case(rows, *shape, torch.bfloat16, bias)
    got = _panel(x, weight, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.float(), _exact(x, weight, b), rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("out", [24, 21])  # eight-feature groups take the vector rounding, the rest the scalar
def test_bf16_rounding_is_torchs_bit_for_bit(out: int) -> None:
    """With an identity weight each output is x + bias, an exact fp32 sum of two bf16 values, so the
    kernel's rounding of it must be torch's to the bit (NaN: a NaN): ties to even, overflow to inf, inf kept."""
    g = torch.Generator().manual_seed(out)
    x = torch.randn(40, out, generator=g).bfloat16()
    bias = (torch.randn(out, generator=g) * 2**-8).bfloat16()  # sums that need rounding, ties among them
    bias[0], bias[2] = float("nan"), float("-inf")
    bias[1], x[3, 1] = 2.0**119, torch.finfo(torch.bfloat16).max  # max + half its ulp: a tie, to inf
    got = _panel(x, torch.eye(out).bfloat16(), bias)
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
        torch.testing.assert_close(_panel(x, w, b).float(), _exact(x, w, b), rtol=tolerance, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_result_does_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    """Threads claim runs of panels as they free up, but each panel's sums are one thread's, in one
    order: any thread count gives the same bits."""
    x, weight, b = _case(37, 1000, 300, dtype, True)
    packed = panel_pack(weight)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(panel_linear(x, packed, b, 1000))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_zero_rows_give_an_empty_output() -> None:
    _, weight, b = _case(1, 24, 8, torch.bfloat16, True)
    assert _panel(torch.empty(0, 8, dtype=torch.bfloat16), weight, b).shape == (0, 24)


def test_it_refuses_what_it_cannot_compute() -> None:
    x, weight, b = _case(3, 30, 8, torch.float32, True)
    packed = panel_pack(weight)
    with pytest.raises(RuntimeError, match="features"):
        panel_linear(x[:, :7], packed, b, 30)
    with pytest.raises(RuntimeError, match="do not fit"):
        panel_linear(x, packed, None, 49)
    with pytest.raises(RuntimeError, match="dtype"):
        panel_linear(x.bfloat16(), packed, b, 30)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        panel_pack(weight.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        panel_linear(x, packed.transpose(0, 1).contiguous().transpose(0, 1), None, 30)
    with pytest.raises(RuntimeError, match="bias"):
        panel_linear(x, packed, b[:8], 30)
    with pytest.raises(RuntimeError, match="panel_pack"):
        panel_linear(x, weight, b, 30)  # a plain weight, not packed
    with pytest.raises(RuntimeError, match="x \\[rows, in\\]"):
        panel_linear(x[0], packed, b, 30)


@pytest.fixture
def panel_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """This CPU as one without AVX-512 (the AMD EPYC Zen 3 CI machines), whatever this one has."""
    monkeypatch.setattr(projections, "panel_linear_preferred", lambda: True)
    monkeypatch.setattr(projections, "native_panel_dot", lambda: False)
    monkeypatch.setattr(projections, "native_panel_wide", lambda: False)


@pytest.fixture
def onednn_preferred(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build for an AVX-512 CPU without the sixteen-lane and dot-product panel kernels (where they
    fail their probes), whatever this one has: oneDNN, not the eight-lane panel kernel."""
    monkeypatch.setattr(projections, "panel_linear_preferred", lambda: False)
    monkeypatch.setattr(projections, "native_panel_dot", lambda: False)
    monkeypatch.setattr(projections, "native_panel_wide", lambda: False)


@pytest.fixture
def no_onednn_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN without a bf16 GEMM (any CPU without AVX-512), whatever this one has."""
    monkeypatch.setattr(projections, "native_panel_dot", lambda: False)
    real = onednn_usable
    monkeypatch.setattr(linear_module, "onednn_usable", lambda dtype: False if dtype == torch.bfloat16 else real(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_sends_rows_past_the_small_ones_to_the_panel_kernel_where_preferred(
    monkeypatch: pytest.MonkeyPatch, panel_preferred: None, dtype: torch.dtype
) -> None:
    _, weight, b = _case(1, 64, 32, dtype, True)
    linear = LinearFactory("auto", "cpu", dtype)(weight, b)
    assert linear.path == "eight" and linear.prepared is not None  # its panels, and no oneDNN copy besides
    panel = record_rows(monkeypatch, "torch.ops.lorafleet.panel_linear")
    small = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    served = small_rows(dtype, "eight")
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    for rows in (1, served, served + 1, 40, 300):
        x = torch.randn(rows, 32).to(dtype)
        got = linear(x)
        assert got.shape == (rows, 64) and got.dtype == dtype
        torch.testing.assert_close(got.float(), _exact(x, weight, b), rtol=tolerance, atol=tolerance)
    assert small == [1, served] and panel == [served + 1, 40, 300]


def test_bf16_takes_the_panel_kernel_where_onednn_has_none_even_where_onednn_is_preferred(
    onednn_preferred: None, no_onednn_bf16: None
) -> None:
    _, weight, _ = _case(1, 64, 32, torch.float32, False)
    assert LinearFactory("auto", "cpu", torch.bfloat16)(weight.bfloat16()).path == "eight"
    fp32 = LinearFactory("auto", "cpu", torch.float32)(weight)
    assert fp32.path == "onednn"


def test_panel_mode_takes_it_for_every_row_and_torch_mode_never(
    monkeypatch: pytest.MonkeyPatch, onednn_preferred: None
) -> None:
    _, weight, b = _case(1, 64, 32, torch.float32, True)
    forced = LinearFactory("panel", "cpu", torch.float32)(weight, b)
    assert forced.small_rows == 0 and forced.path == "eight"
    panel = record_rows(monkeypatch, "torch.ops.lorafleet.panel_linear")
    for rows in (1, 2, 9):
        torch.testing.assert_close(forced(torch.ones(rows, 32)), _exact(torch.ones(rows, 32), weight, b))
    assert panel == [1, 2, 9]
    assert LinearFactory("torch", "cpu", torch.bfloat16)(weight.bfloat16()).path == "torch"
    assert LinearFactory("onednn", "cpu", torch.float32)(weight).path == "onednn"


def test_panel_mode_refuses_to_start_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module.projections, "native_panel_linear", lambda: False)
    monkeypatch.setattr(linear_module.projections, "native_panel_wide", lambda: False)
    with pytest.raises(ValueError, match="cpu_linear='panel' is not usable"):
        LinearFactory("panel", "cpu", torch.float32)
    with pytest.raises(ValueError, match="cpu_linear='panel' is not usable"):
        LinearFactory("panel", "cpu", torch.float16)


def test_bf16_without_onednn_or_the_kernel_warns_at_load(monkeypatch: pytest.MonkeyPatch, no_onednn_bf16: None) -> None:
    """Where neither oneDNN nor the native kernel has a bf16 GEMM, bf16 is still served (on torch's
    reference GEMM) and the load says so."""
    events: list[str] = []
    monkeypatch.setattr(linear_module.projections, "native_panel_linear", lambda: False)
    monkeypatch.setattr(linear_module.log, "warning", lambda event, **_: events.append(event))
    _, weight, _ = _case(1, 64, 32, torch.bfloat16, False)
    linear = LinearFactory("auto", "cpu", torch.bfloat16)(weight)
    assert linear.path == "torch" and events == ["bf16_linear_reference_gemm"]
    torch.testing.assert_close(
        linear(torch.ones(9, 32).bfloat16()).float(), _exact(torch.ones(9, 32), weight, None), rtol=2**-7, atol=2**-7
    )
