"""The native weight-only int4 small-row kernel (kernels/projections.py ``small_linear_int4``) against
``x @ ((q - z) * s).T + bias`` in fp64: every row count it takes, groups of 32, 64 and 128, the engine's
symmetric codes (z = 8) and a checkpoint's per-group z, fp32 and bf16 rows, a bias or none, strided rows;
what it refuses; and which rows the engine's int4 projections (quant.py) send to it."""

import pytest
import torch

from kernels.projections import SMALL_LINEAR_ROWS, native_small_linear_int4, small_linear_int4
from services.worker.engine.linear import LinearFactory
from services.worker.engine.quant import from_codes, pack_nibbles
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain
Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _case(rows: int, out: int, inp: int, group: int, dtype: torch.dtype, zeros: bool, bias: bool) -> Case:
    """x, q [out, in] 0-15, nibbles, scales, zeros or None, bias or None."""
    g = torch.Generator().manual_seed(rows * 131 + out + inp + group)
    x = torch.randn(rows, inp, generator=g).to(dtype)
    q = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scales = (torch.rand(out, inp // group, generator=g) / (7 * inp**0.5)).to(dtype)
    z = torch.randint(0, 17, (out, inp // group), generator=g, dtype=torch.uint8) if zeros else None
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return x, q, pack_nibbles(q), scales, z, b


def _exact(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bias, group: int):
    z = 8.0 if zeros is None else zeros.double().repeat_interleave(group, dim=1)
    weight = (q.double() - z) * scales.double().repeat_interleave(group, dim=1)
    out = x.double() @ weight.T
    return out + bias.double() if bias is not None else out


def test_it_builds_and_passes_its_probe() -> None:
    assert native_small_linear_int4()


@pytest.mark.parametrize("rows", range(1, SMALL_LINEAR_ROWS + 1))
@pytest.mark.parametrize(("shape", "group"), [((960, 576), 32), ((576, 1536), 64), ((49, 256), 128), ((1, 64), 32)])
@pytest.mark.parametrize(("zeros", "bias"), [(False, False), (True, True)], ids=["symmetric", "zeros-bias"])
def test_fp32_equals_the_dequantized_matmul(rows: int, shape: tuple[int, int], group: int, zeros: bool, bias: bool):
    x, q, nibbles, scales, z, b = _case(rows, *shape, group, torch.float32, zeros, bias)
    got = small_linear_int4(x, nibbles, scales, z, b, group)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), _exact(x, q, scales, z, b, group), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize(("shape", "group"), [((960, 576), 32), ((33, 128), 64)])
@pytest.mark.parametrize(("zeros", "bias"), [(False, True), (True, False)], ids=["symmetric-bias", "zeros"])
def test_bf16_is_the_fp32_sum_rounded_once(rows: int, shape: tuple[int, int], group: int, zeros: bool, bias: bool):
    """bf16 rows and scales widen exactly and (q - z) * s is exact in fp32; the only rounding is the
    result's (half a bf16 ulp)."""
    x, q, nibbles, scales, z, b = _case(rows, *shape, group, torch.bfloat16, zeros, bias)
    got = small_linear_int4(x, nibbles, scales, z, b, group)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _exact(x, q, scales, z, b, group), rtol=2**-8, atol=1e-5)


def test_strided_rows_are_read_in_place() -> None:
    wide, q, _, scales, z, b = _case(4, 96, 160, 32, torch.float32, True, True)
    x = wide[:, 16:144]
    q = q[:, :128].contiguous()
    scales, z = scales[:, :4].contiguous(), z[:, :4].contiguous()  # type: ignore[index]
    got = small_linear_int4(x, pack_nibbles(q), scales, z, b, 32)
    torch.testing.assert_close(got.double(), _exact(x, q, scales, z, b, 32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.zeros(SMALL_LINEAR_ROWS + 1, 64)}, "1 to 8 rows"),
        ({"group": 16}, "multiple of 32"),
        ({"group": 48}, "multiple of 32"),
        ({"x": torch.zeros(2, 96), "group": 64}, "dividing the 96"),
        ({"codes": torch.zeros(8, 32, dtype=torch.int8)}, "codes uint8"),
        ({"codes": torch.zeros(8, 16, dtype=torch.uint8)}, "codes uint8"),
        ({"scales": torch.ones(8, 1)}, "scales"),
        ({"scales": torch.ones(8, 2, dtype=torch.bfloat16)}, "scales"),
        ({"zeros": torch.zeros(8, 2, dtype=torch.int32)}, "zeros uint8"),
        ({"zeros": torch.zeros(7, 2, dtype=torch.uint8)}, "zeros uint8"),
        ({"bias": torch.ones(8, dtype=torch.bfloat16)}, "bias"),
        (
            {"x": torch.zeros(2, 64, dtype=torch.float16), "scales": torch.ones(8, 2, dtype=torch.float16)},
            "fp32 or bf16",
        ),
    ],
)
def test_it_refuses_what_it_cannot_compute(change: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "x": torch.zeros(2, 64),
        "codes": torch.zeros(8, 32, dtype=torch.uint8),
        "scales": torch.ones(8, 2),
        "zeros": None,
        "bias": torch.ones(8),
        "group": 32,
    }
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        small_linear_int4(**args)  # type: ignore[arg-type]


def test_fp32_int4_projections_take_it_up_to_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 int4 projection's rows up to SMALL_LINEAR_ROWS run the kernel, more the weight dequantized
    per call; both give the dequantized weight's product."""
    assert native_small_linear_int4()  # its probe's calls before the spy
    rows_seen = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear_int4")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    linear = LinearFactory("auto", "cpu", torch.float32, "int4", 32)(weight, bias)
    quant = linear.quant
    assert quant is not None and quant.small_rows == SMALL_LINEAR_ROWS and quant.codes is not None
    q = torch.stack((quant.codes & 0xF, quant.codes >> 4), dim=-1).view(48, 64)
    for rows in (1, SMALL_LINEAR_ROWS, SMALL_LINEAR_ROWS + 1):
        x = torch.randn(rows, 64, generator=g)
        expected = _exact(x, q, quant.scales, None, bias, 32)
        torch.testing.assert_close(linear(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert rows_seen == [1, SMALL_LINEAR_ROWS]


def test_bf16_int4_projections_keep_torchs_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rows take torch's int4 kernel at every row count (faster than this one there, quant.py): no
    nibbles are kept beside its layout, and the kernel is never called."""
    assert native_small_linear_int4()
    rows_seen = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear_int4")
    linear = LinearFactory("auto", "cpu", torch.bfloat16, "int4", 32)(torch.randn(48, 64).to(torch.bfloat16))
    quant = linear.quant
    assert quant is not None and quant.small_rows == 0 and quant.codes is None and quant.packed is not None
    for rows in (1, SMALL_LINEAR_ROWS + 1):
        assert linear(torch.randn(rows, 64).to(torch.bfloat16)).shape == (rows, 48)
    assert rows_seen == []


def test_a_checkpoints_zeros_reach_the_kernel() -> None:
    """A pre-quantized checkpoint's asymmetric groups (from_codes) run the kernel with their own z."""
    x, q, nibbles, scales, z, _ = _case(2, 32, 128, 64, torch.float32, True, False)
    quant = from_codes(nibbles, scales, z, 64, torch.float32)
    assert quant.small_rows == SMALL_LINEAR_ROWS
    torch.testing.assert_close(quant(x, None).double(), _exact(x, q, scales, z, None, 64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quant(x, None), x @ quant.dequantize().T, rtol=1e-5, atol=1e-5)


def test_a_group_off_its_multiple_keeps_the_other_paths() -> None:
    """A checkpoint's group of 16 (no multiple of 32) is served, past the kernel."""
    x, q, nibbles, scales, _, _ = _case(1, 16, 64, 16, torch.float32, False, False)
    quant = from_codes(nibbles, scales, None, 16, torch.float32)
    assert quant.small_rows == 0
    torch.testing.assert_close(quant(x, None).double(), _exact(x, q, scales, None, None, 16), rtol=1e-5, atol=1e-5)
