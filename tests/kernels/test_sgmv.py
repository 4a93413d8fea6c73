"""SGMV kernels (interpreted on CPU, compiled on CUDA: tests/kernels/conftest.py) against the torch reference and the fp32 loop."""

import pytest
import torch

from kernels import index_for, reference
from kernels.sgmv import BLOCK_M, sgmv_expand, sgmv_shrink
from tests.kernels.conftest import DEVICE, KERNEL_CASES, TOLERANCE, loop_lora, make_weights, spread_rows

SHAPES = [(64, 96), (160, 48)]  # (in, out); 160 and 48 are not powers of two


def run_sgmv(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    index = index_for(rows, DEVICE)
    h = torch.empty(index.num_tokens, a.shape[2])
    segs = (index.seg_start, index.seg_row, index.max_seg_len)
    sgmv_shrink(x, a, index.token_idx, index.token_row, *segs, h)
    torch.testing.assert_close(h, reference.shrink(x, a, index.token_idx, index.token_row), atol=1e-5, rtol=1e-5)
    sgmv_expand(h, b, scale, index.token_idx, index.token_row, *segs, y)
    return y


@pytest.mark.parametrize(("dtype", "rank", "spread"), KERNEL_CASES)
def test_sgmv_matches_reference_and_loop(dtype: torch.dtype, rank: int, spread: str, gen: torch.Generator) -> None:
    in_features, out_features = SHAPES[rank % 3 % 2]
    num_tokens, num_rows = 40, 6  # segments longer than BLOCK_M in the identical / skewed spreads
    a, b, scale = make_weights(num_rows, in_features, rank, out_features, dtype, gen)
    rows = spread_rows(spread, num_tokens, num_rows, gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)

    out = run_sgmv(x, y.clone(), a, b, scale, rows)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), loop_lora(x, y, a, b, scale, rows), atol=atol, rtol=rtol)
    untouched = rows < 0
    assert torch.equal(out[untouched], y[untouched])


def test_sgmv_prefill_runs_spanning_several_tiles(gen: torch.Generator) -> None:
    """Contiguous prompts of uneven lengths, as a prefill step lays them out."""
    a, b, scale = make_weights(3, 48, 16, 40, torch.float32, gen)
    lengths, slots = [BLOCK_M * 2 + 3, 1, BLOCK_M, 7], [2, 0, -1, 2]
    rows = torch.cat([torch.full((n,), s) for n, s in zip(lengths, slots, strict=True)])
    x = torch.randn(rows.shape[0], 48, generator=gen)
    y = torch.randn(rows.shape[0], 40, generator=gen)
    out = run_sgmv(x, y.clone(), a, b, scale, rows)
    torch.testing.assert_close(out, loop_lora(x, y, a, b, scale, rows), atol=2e-5, rtol=1e-4)


def test_sgmv_expand_adds_into_a_column_view_of_a_fused_output(gen: torch.Generator) -> None:
    a, b, scale = make_weights(2, 32, 8, 24, torch.float32, gen)
    rows = torch.tensor([1, 1, 1, -1, 0, 0])
    x = torch.randn(6, 32, generator=gen)
    fused = torch.randn(6, 64, generator=gen)
    expected = fused.clone()
    expected[:, 40:] = loop_lora(x, fused[:, 40:], a, b, scale, rows)
    run_sgmv(x, fused[:, 40:], a, b, scale, rows)
    torch.testing.assert_close(fused, expected)


def test_sgmv_launcher_refuses_bad_segments(gen: torch.Generator) -> None:
    a, _, _ = make_weights(2, 32, 8, 16, torch.float32, gen)
    index = index_for(torch.tensor([0, 0, 1]), DEVICE)
    h = torch.empty(3, 8)
    x, idx, rows = torch.randn(3, 32), index.token_idx, index.token_row
    with pytest.raises(AssertionError, match="num_segments"):
        sgmv_shrink(x, a, idx, rows, index.seg_start[:-1], index.seg_row, 2, h)
    with pytest.raises(AssertionError, match="int32"):
        sgmv_shrink(x, a, idx, rows, index.seg_start.long(), index.seg_row, 2, h)
