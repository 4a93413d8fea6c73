"""The native weight-only int8 small-row kernel (kernels/projections.py ``small_linear_int8``) against
``x @ (codes * scales).T + bias`` in fp64: every row count it takes, fp32 and bf16 rows, a bias or none,
widths that are no multiple of a vector, strided rows; what it refuses; and which rows the engine's
int8 projections (quant.py) send to it."""

import pytest
import torch

from kernels.projections import SMALL_LINEAR_ROWS, native_small_linear_int8, small_linear_int8
from services.worker.engine.linear import LinearFactory
from tests.helpers.native import needs_toolchain, record_rows

pytestmark = needs_toolchain


def _case(
    rows: int, out: int, inp: int, dtype: torch.dtype, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(rows * 131 + out + inp)
    x = torch.randn(rows, inp, generator=g).to(dtype)
    codes = torch.randint(-127, 128, (out, inp), generator=g, dtype=torch.int8)
    scales = (torch.rand(out, generator=g) / (127 * inp**0.5)).to(dtype)
    return x, codes, scales, torch.randn(out, generator=g).to(dtype) if bias else None


def _exact(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ (codes.double() * scales.double()[:, None]).T
    return out + bias.double() if bias is not None else out


def test_it_builds_and_passes_its_probe() -> None:
    assert native_small_linear_int8()


@pytest.mark.parametrize("rows", range(1, SMALL_LINEAR_ROWS + 1))
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (49, 37), (1, 16), (130, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_the_dequantized_matmul(rows: int, shape: tuple[int, int], bias: bool) -> None:
    x, codes, scales, b = _case(rows, *shape, torch.float32, bias)
    got = small_linear_int8(x, codes, scales, b)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    torch.testing.assert_close(got.double(), _exact(x, codes, scales, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 4, 8])
@pytest.mark.parametrize("shape", [(960, 576), (49, 37), (33, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_is_the_fp32_sum_rounded_once(rows: int, shape: tuple[int, int], bias: bool) -> None:
    """bf16 rows and scales widen exactly; the only rounding is the result's (half a bf16 ulp)."""
    x, codes, scales, b = _case(rows, *shape, torch.bfloat16, bias)
    got = small_linear_int8(x, codes, scales, b)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _exact(x, codes, scales, b), rtol=2**-8, atol=1e-5)


def test_strided_rows_are_read_in_place() -> None:
    wide, codes, scales, b = _case(4, 96, 100, torch.float32, True)
    x = wide[:, 10:90]
    c = codes[:, :80].contiguous()
    torch.testing.assert_close(
        small_linear_int8(x, c, scales, b).double(), _exact(x, c, scales, b), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"x": torch.zeros(SMALL_LINEAR_ROWS + 1, 16)}, "1 to 8 rows"),
        ({"x": torch.zeros(2, 15)}, "features"),
        ({"codes": torch.zeros(8, 16)}, "codes int8"),
        ({"scales": torch.ones(7)}, "scales"),
        ({"scales": torch.ones(8, dtype=torch.bfloat16)}, "scales"),
        ({"bias": torch.ones(8, dtype=torch.bfloat16)}, "bias"),
        ({"x": torch.zeros(2, 16, dtype=torch.float16), "scales": torch.ones(8, dtype=torch.float16)}, "fp32 or bf16"),
    ],
)
def test_it_refuses_what_it_cannot_compute(change: dict[str, torch.Tensor], message: str) -> None:
    args = {"x": torch.zeros(2, 16), "codes": torch.zeros(8, 16, dtype=torch.int8), "scales": torch.ones(8)}
    args["bias"] = torch.ones(8)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        small_linear_int8(args["x"], args["codes"], args["scales"], args["bias"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_projections_take_it_up_to_its_rows(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """An int8 projection's rows up to SMALL_LINEAR_ROWS run the kernel, more the other paths; both
    give the dequantized weight's product."""
    assert native_small_linear_int8()  # its probe's calls before the spy
    rows_seen = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear_int8")
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(40, 48, generator=g), torch.randn(40, generator=g).to(dtype)
    linear = LinearFactory("auto", "cpu", dtype, "int8")(weight.to(dtype), bias)
    quant = linear.quant
    assert quant is not None and quant.small_rows == SMALL_LINEAR_ROWS and quant.codes is not None
    for rows in (1, SMALL_LINEAR_ROWS, SMALL_LINEAR_ROWS + 1):
        x = torch.randn(rows, 48, generator=g).to(dtype)
        expected = _exact(x, quant.codes, quant.scales, bias)
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # bf16: the output's rounding
        torch.testing.assert_close(linear(x).double(), expected, rtol=tolerance, atol=tolerance)
    assert rows_seen == [1, SMALL_LINEAR_ROWS]
