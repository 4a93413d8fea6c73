"""The native CPU LoRA kernel (kernels/native.py's ``lora_bgmv``) against the plain fp32 loop: every
spread of tokens over adapters, the compiled ranks (8, 16, 32, 64) and run-time ones, fp32 and bf16,
a column view of a fused output; its input checks; and the dispatch's choice (``use_native_lora``,
decode-like steps to the kernel, long prefill segments to the segment loop's matmuls)."""

import pytest
import torch

from kernels import LoraGroup, add_lora, add_lora_group, dispatch, index_for
from kernels.native import lora_bgmv, lora_bgmv_group, native_lora
from kernels.reference import INDEX_DTYPE
from tests.helpers.native import needs_toolchain
from tests.kernels.conftest import ON_CPU, SPREADS, TOLERANCE, loop_lora, make_weights, spread_rows

pytestmark = [pytest.mark.skipif(not ON_CPU, reason="a CPU kernel"), needs_toolchain]

NATIVE_DTYPES = [torch.float32, torch.bfloat16]


def test_it_builds_and_passes_its_probe() -> None:
    """With an x86-64 g++ (and the ninja wheel, a dependency) a failed build or probe is a defect."""
    assert native_lora()


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rank", [8, 16, 32, 64, 1, 12, 100])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_matches_the_loop(spread: str, rank: int, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Into a column view of a wider output: the indexed rows get their delta, every other element is
    left bit-identical (base tokens, the columns beside the view)."""
    num_tokens, num_rows, in_features, out_features = 24, 8, 96, 300  # 300: two output chunks, one partial
    a, b, scale = make_weights(num_rows, in_features, rank, out_features, dtype, gen)
    rows = spread_rows(spread, num_tokens, num_rows, gen)
    x = torch.randn(num_tokens, in_features + 5, generator=gen).to(dtype)[:, 5:]  # rows strided past 5 columns
    fused = torch.randn(num_tokens, out_features + 40, generator=gen).to(dtype)
    y = fused[:, 20 : 20 + out_features]
    expected = loop_lora(x, y, a, b, scale, rows)
    before = fused.clone()
    index = index_for(rows)
    lora_bgmv(x, y, a, b, scale, index.token_idx, index.token_row)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y.float(), expected, atol=atol, rtol=rtol)
    assert torch.equal(y[rows < 0], before[:, 20 : 20 + out_features][rows < 0])
    assert torch.equal(fused[:, :20], before[:, :20]) and torch.equal(fused[:, -20:], before[:, -20:])


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rank", [16, 12])
@pytest.mark.parametrize("dtype", NATIVE_DTYPES, ids=str)
def test_a_group_adds_each_member_into_its_own_columns(
    spread: str, rank: int, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """q, k, v of one layer in one call (given out of column order, k left out of a q,v group): each
    member's columns get exactly what its own call adds, the columns of members not given are
    bit-identical, as are base tokens' rows."""
    num_tokens, num_rows, in_features, widths = 12, 5, 64, (96, 32, 32)
    weights = [make_weights(num_rows, in_features, rank, out, dtype, gen) for out in widths]
    scale = weights[0][2]
    cols = (0, 96, 128)
    rows = spread_rows(spread, num_tokens, num_rows, gen)
    index = index_for(rows)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    fused = torch.randn(num_tokens, sum(widths), generator=gen).to(dtype)
    for members in ((2, 0, 1), (2, 0)):
        expected = fused.clone()
        for m in members:
            a, b, _ = weights[m]
            view = expected[:, cols[m] : cols[m] + widths[m]]
            lora_bgmv(x, view, a, b, scale, index.token_idx, index.token_row)
        got = fused.clone()
        a_list, b_list = [weights[m][0] for m in members], [weights[m][1] for m in members]
        lora_bgmv_group(x, got, a_list, b_list, [cols[m] for m in members], scale, index.token_idx, index.token_row)
        assert torch.equal(got, expected)
        assert torch.equal(got[rows < 0], fused[rows < 0])
        if 1 not in members:
            assert torch.equal(got[:, 96:128], fused[:, 96:128])


def test_a_group_refuses_what_it_cannot_serve(gen: torch.Generator) -> None:
    a, b, scale = make_weights(3, 32, 8, 24, torch.float32, gen)
    a2, b2, _ = make_weights(3, 32, 8, 16, torch.float32, gen)
    a4, b4, _ = make_weights(3, 32, 4, 16, torch.float32, gen)
    x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 40, generator=gen)
    idx, row = torch.tensor([0, 3], dtype=INDEX_DTYPE), torch.tensor([1, 2], dtype=INDEX_DTYPE)
    lora_bgmv_group(x, y, [a, a2], [b, b2], [0, 24], scale, idx, row)  # the valid call
    cases = {
        "no projection": ([], [], []),
        "lists of different lengths": ([a, a2], [b], [0, 24]),
        "columns missing": ([a, a2], [b, b2], [0]),
        "overlapping columns": ([a, a2], [b, b2], [0, 20]),
        "columns past y": ([a, a2], [b, b2], [0, 25]),
        "negative column": ([a, a2], [b, b2], [-1, 24]),
        "ranks differ": ([a, a4], [b, b4], [0, 24]),
        "slots differ": ([a, a2[:2]], [b, b2[:2]], [0, 24]),
        "b not matching a": ([a, a2], [b, b2[:, :4]], [0, 24]),
    }
    for name, (a_list, b_list, cols) in cases.items():
        with pytest.raises(RuntimeError):
            lora_bgmv_group(x, y, a_list, b_list, cols, scale, idx, row)
            pytest.fail(f"accepted: {name}")


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1] * 200], ids=["decode", "prefill"])
def test_dispatch_of_a_group_matches_member_by_member(rows: list[int], gen: torch.Generator) -> None:
    """add_lora_group: one native call for a decode step, the member-by-member eager forms for a long
    prefill segment and where native is off; all agree."""
    weights = [make_weights(4, 32, 16, out, torch.float32, gen) for out in (24, 8)]
    scale = weights[0][2]
    group = LoraGroup(a=(weights[0][0], weights[1][0]), b=(weights[0][1], weights[1][1]), cols=(8, 0))
    token_rows = torch.tensor(rows)
    x = torch.randn(len(rows), 32, generator=gen)
    fused = torch.randn(len(rows), 40, generator=gen)
    expected = fused.clone()
    expected[:, 8:32] = loop_lora(x, fused[:, 8:32], *weights[0], token_rows)
    expected[:, :8] = loop_lora(x, fused[:, :8], *weights[1][:2], scale, token_rows)
    for native in (True, False):
        got = fused.clone()
        add_lora_group(x, got, group, scale, index_for(token_rows), torch.empty(0), native=native)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
        assert torch.equal(got[:, 32:], fused[:, 32:])


def test_bf16_rounds_the_delta_before_adding_it_as_the_eager_path_does(gen: torch.Generator) -> None:
    """y + bf16(delta), rounded: bit-identical to ``y.add_(delta.to(bf16))`` on an fp32 delta."""
    a, b, scale = make_weights(3, 64, 16, 48, torch.bfloat16, gen)
    rows = torch.tensor([2, 0, 1, 2])
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    y = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    delta = loop_lora(x, torch.zeros(4, 48), a, b, scale, rows)
    index = index_for(rows)
    got = y.clone()
    lora_bgmv(x, got, a, b, scale, index.token_idx, index.token_row)
    want = y.clone().add_(delta.to(torch.bfloat16))
    # the fp32 deltas differ only in summation order, so at most one bf16 step apart per element
    assert (got.float() - want.float()).abs().le(want.float().abs() * 2**-7 + 1e-6).all()


def test_threads_split_tokens_without_changing_results(gen: torch.Generator) -> None:
    """64 tokens of 16 adapters on one thread and on two: identical outputs (each token is one task)."""
    a, b, scale = make_weights(16, 576, 16, 576, torch.float32, gen)
    rows = torch.randint(16, (64,), generator=gen)
    x = torch.randn(64, 576, generator=gen)
    y = torch.randn(64, 576, generator=gen)
    index = index_for(rows)
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = y.clone()
            lora_bgmv(x, out, a, b, scale, index.token_idx, index.token_row)
            outputs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])
    torch.testing.assert_close(outputs[0], loop_lora(x, y, a, b, scale, rows), atol=2e-5, rtol=1e-4)


def test_refuses_inputs_it_cannot_serve(gen: torch.Generator) -> None:
    a, b, scale = make_weights(3, 32, 8, 24, torch.float32, gen)
    x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 24, generator=gen)
    idx, row = torch.tensor([0, 3], dtype=INDEX_DTYPE), torch.tensor([1, 2], dtype=INDEX_DTYPE)
    lora_bgmv(x, y, a, b, scale, idx, row)  # the valid call
    cases = {
        "dtype": (x.double(), y.double(), a.double(), b.double(), scale, idx, row),
        "mixed dtypes": (x.to(torch.bfloat16), y, a, b, scale, idx, row),
        "token out of range": (x, y, a, b, scale, torch.tensor([0, 4], dtype=INDEX_DTYPE), row),
        "row out of range": (x, y, a, b, scale, idx, torch.tensor([1, 3], dtype=INDEX_DTYPE)),
        "int64 index": (x, y, a, b, scale, idx.long(), row.long()),
        "strided columns": (x, y.t().contiguous().t(), a, b, scale, idx, row),
        "b not matching a": (x, y, a, b[:, :4], scale, idx, row),
        "scale dtype": (x, y, a, b, scale.double(), idx, row),
    }
    for name, args in cases.items():
        with pytest.raises(RuntimeError):
            lora_bgmv(*args)
            pytest.fail(f"accepted: {name}")


def test_use_native_lora_follows_its_mode() -> None:
    assert dispatch.use_native_lora("auto", "cpu", torch.float32)
    assert dispatch.use_native_lora("native", "cpu", torch.bfloat16)
    assert not dispatch.use_native_lora("torch", "cpu", torch.float32)
    assert not dispatch.use_native_lora("auto", "cpu", torch.float16)
    with pytest.raises(ValueError, match="cpu_kernel='native'"):
        dispatch.use_native_lora("native", "cpu", torch.float16)


@pytest.mark.parametrize(
    ("rows", "path"),
    [
        ([0, 1, 2, 3], "native"),  # a decode step of distinct adapters
        ([2], "native"),  # a batch-1 decode
        ([1] * 40 + [0] * 40, "native"),  # two short prompts: 40 tokens per segment
        ([1] * 200, "segments"),  # a prefill past NATIVE_MAX_MEAN_SEG_LEN: the matmuls
    ],
)
def test_dispatch_takes_the_kernel_for_decode_like_steps(
    rows: list[int], path: str, monkeypatch: pytest.MonkeyPatch, gen: torch.Generator
) -> None:
    taken: list[str] = []
    real_native, real_segments = dispatch.lora_bgmv, dispatch.add_lora_segments
    monkeypatch.setattr(dispatch, "lora_bgmv", lambda *a: (taken.append("native"), real_native(*a)))
    monkeypatch.setattr(dispatch, "add_lora_segments", lambda *a: (taken.append("segments"), real_segments(*a)))
    a, b, scale = make_weights(4, 32, 16, 24, torch.float32, gen)
    token_rows = torch.tensor(rows)
    x = torch.randn(len(rows), 32, generator=gen)
    fused = torch.randn(len(rows), 48, generator=gen)
    expected = fused.clone()
    expected[:, 8:32] = loop_lora(x, fused[:, 8:32], a, b, scale, token_rows)
    add_lora(x, fused[:, 8:32], a, b, scale, index_for(token_rows), torch.empty(0), native=True)
    torch.testing.assert_close(fused, expected, atol=2e-5, rtol=1e-4)
    assert taken == [path]
