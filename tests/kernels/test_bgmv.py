"""BGMV kernels (interpreted on CPU, compiled on CUDA: tests/kernels/conftest.py) against the torch reference and the fp32 loop."""

import pytest
import torch

from kernels import index_for, reference
from kernels.bgmv import bgmv_expand, bgmv_shrink
from tests.kernels.conftest import DEVICE, KERNEL_CASES, ON_CPU, TOLERANCE, loop_lora, make_weights, spread_rows

SHAPES = [(64, 96), (160, 48)]  # (in, out); 160 and 48 are not powers of two


@pytest.mark.parametrize(("dtype", "rank", "spread"), KERNEL_CASES)
def test_bgmv_matches_reference_and_loop(dtype: torch.dtype, rank: int, spread: str, gen: torch.Generator) -> None:
    in_features, out_features = SHAPES[rank % 3 % 2]
    num_tokens, num_rows = 12, 8
    a, b, scale = make_weights(num_rows, in_features, rank, out_features, dtype, gen)
    rows = spread_rows(spread, num_tokens, num_rows, gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    index = index_for(rows, DEVICE)

    h = torch.empty(index.num_tokens, rank)
    bgmv_shrink(x, a, index.token_idx, index.token_row, h)
    h_ref = reference.shrink(x, a, index.token_idx, index.token_row)
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)

    out = y.clone()
    bgmv_expand(h, b, scale, index.token_idx, index.token_row, out)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), loop_lora(x, y, a, b, scale, rows), atol=atol, rtol=rtol)
    untouched = rows < 0
    assert torch.equal(out[untouched], y[untouched])


def test_bgmv_expand_adds_into_a_column_view_of_a_fused_output(gen: torch.Generator) -> None:
    a, b, scale = make_weights(4, 32, 8, 24, torch.float32, gen)
    rows = torch.tensor([0, 3, -1, 1, 3])
    x = torch.randn(5, 32, generator=gen)
    fused = torch.randn(5, 64, generator=gen)
    expected = fused.clone()
    expected[:, 16:40] = loop_lora(x, fused[:, 16:40], a, b, scale, rows)
    index = index_for(rows, DEVICE)
    h = torch.empty(index.num_tokens, 8)
    bgmv_shrink(x, a, index.token_idx, index.token_row, h)
    bgmv_expand(h, b, scale, index.token_idx, index.token_row, fused[:, 16:40])
    torch.testing.assert_close(fused, expected)


def test_bgmv_launcher_refuses_bad_operands(gen: torch.Generator) -> None:
    a, b, scale = make_weights(2, 32, 8, 16, torch.float32, gen)
    index = index_for(torch.tensor([0, 1]), DEVICE)
    x = torch.randn(2, 32)
    h = torch.empty(2, 8)
    with pytest.raises(AssertionError, match=r"dtype|is torch"):
        bgmv_shrink(x.half(), a, index.token_idx, index.token_row, h)
    with pytest.raises(AssertionError, match="in="):
        bgmv_shrink(torch.randn(2, 16), a, index.token_idx, index.token_row, h)
    with pytest.raises(AssertionError, match="int32"):
        bgmv_shrink(x, a, index.token_idx.long(), index.token_row.long(), h)
    with pytest.raises(AssertionError, match="contiguous"):
        strided_b = b.transpose(1, 2).contiguous().transpose(1, 2)
        bgmv_expand(h, strided_b, scale, index.token_idx, index.token_row, x[:, :16])
    with pytest.raises(AssertionError, match="fp32"):
        bgmv_expand(h.half(), b, scale, index.token_idx, index.token_row, torch.zeros(2, 16))


def test_the_kernel_is_interpreted_on_cpu_and_compiled_on_cuda() -> None:
    """Under TRITON_INTERPRET the jit function is interpreted on CPU tensors; on CUDA it is compiled."""
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import bgmv

    assert isinstance(bgmv._bgmv_shrink_kernel, InterpretedFunction) == ON_CPU
