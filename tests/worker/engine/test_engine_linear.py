"""The engine's dense projections: oneDNN-prepacked weights agree with F.linear, and the policy
(which rows take which path, which dtypes may pack) is what the config asks for."""

import pytest
import torch
import torch.nn.functional as F

from services.worker.engine.linear import LinearFactory, onednn_usable, padded_rows
from tests.helpers.native import record_rows


def _case(rows: int, out: int, inp: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(rows * 31 + out)
    return (
        torch.randn(rows, inp, generator=g),
        torch.randn(out, inp, generator=g) / inp**0.5,
        torch.randn(out, generator=g) if bias else None,
    )


def test_onednn_is_usable_for_fp32_and_bf16_on_this_cpu_and_never_for_fp16():
    assert onednn_usable(torch.float32)  # x86 torch builds ship oneDNN: the probe must find it
    # bf16 wherever oneDNN has a bf16 path (AVX-512BW or newer, as on the CI machines)
    assert onednn_usable(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not onednn_usable(torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 33, 41, 127, 200])
@pytest.mark.parametrize("shape", [(832, 576), (576, 1536), (1000, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_auto_linear_equals_f_linear(rows: int, shape: tuple[int, int], bias: bool):
    x, weight, b = _case(rows, *shape, bias)
    linear = LinearFactory("auto", "cpu", torch.float32)(weight, b)
    assert linear.path != "torch" and linear.prepared is not None  # oneDNN's or the native panel kernel's copy
    torch.testing.assert_close(linear(x), F.linear(x, weight, b), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not onednn_usable(torch.bfloat16), reason="oneDNN has no bf16 path on this CPU")
@pytest.mark.parametrize("rows", [1, 2, 9, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_auto_linear_in_bf16_equals_f_linear_within_bf16_rounding(rows: int, bias: bool):
    """Both accumulate in fp32; the outputs differ by at most the rounding of a bf16 result."""
    x, weight, b = _case(rows, 832, 576, bias)
    x, weight = x.bfloat16(), weight.bfloat16()
    b = b.bfloat16() if b is not None else None
    linear = LinearFactory("auto", "cpu", torch.bfloat16)(weight, b)
    assert linear.path != "torch" and linear.prepared is not None
    got = linear(x)
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), b.float() if b is not None else None)
    torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=2**-7)


def test_every_row_count_takes_the_packed_path_a_single_row_unpadded(monkeypatch):
    """The packed path serves decode steps and prefills alike (oneDNN is 2x MKL's fp32 GEMM on a
    prefill here too), at the padded row counts, a single row as it is (``onednn`` sends it every row
    count; ``auto`` sends it all but a small batch's, tests/worker/engine/test_small_linear.py)."""
    _, weight, _ = _case(1, 64, 32, False)
    rows = [1, 5, 8, 128, 129, 1405]
    linear = LinearFactory("onednn", "cpu", torch.float32)(weight)
    calls = record_rows(monkeypatch, "torch.ops.mkldnn._linear_pointwise")
    for count in rows:
        assert linear(torch.randn(count, 32)).shape == (count, 64)
    assert calls == [1, 8, 8, 128, 160, 1536]
    assert calls == [padded_rows(count) for count in rows]


def test_torch_mode_and_other_dtypes_never_pack():
    _, weight, _ = _case(1, 64, 32, False)
    for linear in (
        LinearFactory("torch", "cpu", torch.float32)(weight),
        LinearFactory("torch", "cpu", torch.bfloat16)(weight.bfloat16()),
        LinearFactory("auto", "cpu", torch.float16)(weight.half()),
    ):
        assert linear.path == "torch" and linear.prepared is None
    with pytest.raises(ValueError, match="not usable"):
        LinearFactory("onednn", "cpu", torch.float16)


def test_packed_row_counts_are_few_buckets_with_bounded_padding():
    """oneDNN keeps a primitive (and its memory) per row count: the packed path runs at 13 row counts
    over 1-128 (one row unpadded), never pads more than 25% past 32 rows (7 rows below), and never
    shrinks an input."""
    buckets = {padded_rows(r) for r in range(1, 129)}
    assert buckets == {1, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128}
    for rows in range(1, 5000):
        padded = padded_rows(rows)
        assert padded >= rows and padded_rows(padded) == padded
        assert padded - rows <= (7 if rows <= 32 else rows // 4)
    assert len({padded_rows(r) for r in range(1, 2049)}) == 1 + 4 + 4 * 6  # four per doubling past 32
