"""The torch reference (gathered and segmented forms) against the plain fp32 loop."""

import pytest
import torch

from kernels import add_lora, dispatch, find_segments, index_for, reference
from kernels.bags import add_lora_bags
from tests.kernels.conftest import DTYPES, ON_CPU, RANKS, SPREADS, TOLERANCE, loop_lora, make_weights, spread_rows

pytestmark = pytest.mark.skipif(not ON_CPU, reason="the torch reference and the CPU dispatch run on the CPU")


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_both_forms_match_the_loop(spread: str, rank: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    num_tokens, num_rows, in_features, out_features = 24, 8, 96, 80
    a, b, scale = make_weights(num_rows, in_features, rank, out_features, dtype, gen)
    rows = spread_rows(spread, num_tokens, num_rows, gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    expected = loop_lora(x, y, a, b, scale, rows)
    index = index_for(rows)
    atol, rtol = TOLERANCE[dtype]

    gathered = y.clone()
    reference.add_lora_gathered(x, gathered, a, b, scale, index.token_idx, index.token_row)
    torch.testing.assert_close(gathered.float(), expected, atol=atol, rtol=rtol)

    segmented = y.clone()
    reference.add_lora_segments(x, segmented, a, b, scale, index.token_idx, index.segments)
    torch.testing.assert_close(segmented.float(), expected, atol=atol, rtol=rtol)
    assert torch.equal(segmented[rows < 0], y[rows < 0])

    if dtype == torch.float32:  # the CPU decode path; fp32 only (kernels/bags.py)
        bagged = y.clone()
        plan = index.bag_plan()
        add_lora_bags(x, bagged, a, b, scale, plan)
        torch.testing.assert_close(bagged, expected, atol=atol, rtol=rtol)
        assert torch.equal(bagged[rows < 0], y[rows < 0])
        assert index.bag_plan() is plan  # built once per step, reused by every later call
        assert set(plan._bags) == {in_features, rank}  # the bag indices: once per width


def test_segments_mark_contiguous_runs_only() -> None:
    rows = torch.tensor([2, 2, 2, 0, 2, -1, 1, 1])
    index = index_for(rows)
    # row 0: token 3 (a run of one); row 1: tokens 6, 7 (a run); row 2: tokens 0, 1, 2, 4 (not a run)
    assert index.segments == ((0, 1, 0, 3), (1, 3, 1, 6), (3, 7, 2, -1))
    assert index.token_idx.tolist() == [3, 6, 7, 0, 1, 2, 4]
    assert index.seg_start.tolist() == [0, 1, 3, 7] and index.seg_row.tolist() == [0, 1, 2]
    assert index.max_seg_len == 4
    assert find_segments([], []) == ()
    assert find_segments([4, 5, 1, 7, 2], [0, 0, 1, 1, 3]) == ((0, 2, 0, 4), (2, 4, 1, -1), (4, 5, 3, 2))


def _check_fused_column_view(rows: list[int], gen: torch.Generator) -> None:
    """add_lora into the first 24 columns of a 48-wide fused output equals the loop, other columns untouched."""
    a, b, scale = make_weights(4, 32, 16, 24, torch.float32, gen)
    token_rows = torch.tensor(rows)
    x = torch.randn(len(rows), 32, generator=gen)
    fused = torch.randn(len(rows), 48, generator=gen)
    expected = fused.clone()
    expected[:, :24] = loop_lora(x, fused[:, :24], a, b, scale, token_rows)
    add_lora(x, fused[:, :24], a, b, scale, index_for(token_rows), torch.empty(0))
    torch.testing.assert_close(fused, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 1, 1, 1, 0, 0, -1, 3], [2] * 9 + [-1, 0, 0] + [2] * 4])
def test_cpu_dispatch_adds_into_a_fused_column_view(rows: list[int], gen: torch.Generator) -> None:
    _check_fused_column_view(rows, gen)


def test_cpu_dispatch_takes_the_bag_path_for_fp32_decode_and_the_gathered_one_for_half(monkeypatch, gen) -> None:
    taken: list[str] = []
    real_bags, real_gathered = dispatch.add_lora_bags, dispatch.add_lora_gathered
    monkeypatch.setattr(dispatch, "add_lora_bags", lambda *a: (taken.append("bags"), real_bags(*a)))
    monkeypatch.setattr(dispatch, "add_lora_gathered", lambda *a: (taken.append("gathered"), real_gathered(*a)))
    rows = torch.arange(6)
    for dtype in (torch.float32, torch.bfloat16):
        a, b, scale = make_weights(6, 32, 8, 24, dtype, gen)
        x, y = torch.randn(6, 32, generator=gen).to(dtype), torch.randn(6, 24, generator=gen).to(dtype)
        expected = loop_lora(x, y, a, b, scale, rows)
        add_lora(x, y, a, b, scale, index_for(rows), torch.empty(0))
        torch.testing.assert_close(y.float(), expected, atol=TOLERANCE[dtype][0], rtol=TOLERANCE[dtype][1])
    assert taken == ["bags", "gathered"]


@pytest.mark.parametrize("rows", [[2], [3, 3, 3, 3], [-1, 1, 1, -1]])
def test_cpu_dispatch_takes_the_segment_loop_for_a_single_segment(
    rows: list[int], monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    """A batch-1 decode (or one adapter's tokens) is one matmul pair on views, accumulated into the
    fused output's column view in place, not a bag per token."""
    taken: list[str] = []
    real_segments = dispatch.add_lora_segments
    monkeypatch.setattr(dispatch, "add_lora_segments", lambda *a: (taken.append("segments"), real_segments(*a)))
    monkeypatch.setattr(dispatch, "add_lora_bags", lambda *a: taken.append("bags"))
    _check_fused_column_view(rows, gen)
    assert taken == ["segments"]


def test_the_bag_plan_reads_views_for_one_run_of_positions_and_gathers_otherwise(gen: torch.Generator) -> None:
    """Tokens 2..5 all on adapters: x and y are read as row views. A base token among them: gathered and
    index-added. Both agree with the loop, and the base token's row is left alone."""
    a, b, scale = make_weights(4, 32, 8, 24, torch.float32, gen)
    x = torch.randn(7, 32, generator=gen)
    for rows, first in (([-1, -1, 3, 0, 3, 1, -1], 2), ([0, 2, -1, 1, 1, 3, 0], -1)):
        token_rows = torch.tensor(rows)
        index = index_for(token_rows)
        plan = index.bag_plan()
        assert plan.first == first
        assert plan.positions.tolist() == [i for i, r in enumerate(rows) if r >= 0]
        assert plan.rows.tolist() == [r for r in rows if r >= 0]
        y = torch.randn(7, 24, generator=gen)
        expected = loop_lora(x, y, a, b, scale, token_rows)
        add_lora_bags(x, y, a, b, scale, plan)
        torch.testing.assert_close(y, expected, atol=2e-5, rtol=1e-4)
