"""engine.experts against a plain loop over each token's top-k experts (fp32), for the routings a step
can hold: every token on the same experts, all distinct, random; and its small-row kernel path."""

import pytest
import torch
import torch.nn.functional as F

from kernels import projections
from services.worker.engine.experts import ExpertWeights, moe_mlp, route
from tests.helpers.native import needs_toolchain, record_rows

EXPERTS, HIDDEN, INTER = 8, 48, 40


def _weights(top_k: int, normalise: bool, fp32_weights: bool = False) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    return ExpertWeights(
        router=torch.randn(EXPERTS, HIDDEN, generator=g),
        gate_up=torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5,
        down=torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5,
        top_k=top_k,
        normalise=normalise,
        fp32_weights=fp32_weights,
        shared_gate=None,
    )


def _reference(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.softmax(F.linear(x[t], w.router), dim=-1)
        top, experts = torch.topk(probs, w.top_k)
        if w.normalise:
            top = top / top.sum()
        for weight, e in zip(top.tolist(), experts.tolist(), strict=True):
            gate, up = F.linear(x[t], w.gate_up[e]).chunk(2)
            out[t] += weight * F.linear(F.silu(gate) * up, w.down[e])
    return out


def _rows(n: int, spread: str, w: ExpertWeights) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    if spread == "random":
        return torch.randn(n, HIDDEN, generator=g)
    if spread == "same":  # one row repeated: every token on the same top-k experts
        return torch.randn(1, HIDDEN, generator=g).expand(n, HIDDEN).contiguous()
    # distinct: each row along one expert's router direction, so each picks that expert first
    return w.router[torch.arange(n) % EXPERTS] * 3 + 0.1 * torch.randn(n, HIDDEN, generator=g)


@pytest.mark.parametrize("spread", ["random", "same", "distinct"])
@pytest.mark.parametrize("n", [1, 3, 8, 37])
@pytest.mark.parametrize(("top_k", "normalise"), [(1, False), (2, True), (3, False)])
def test_moe_mlp_equals_a_loop_over_each_tokens_experts(n: int, spread: str, top_k: int, normalise: bool) -> None:
    w = _weights(top_k, normalise)
    x = _rows(n, spread, w)
    torch.testing.assert_close(moe_mlp(x, w, F.silu), _reference(x, w), atol=1e-5, rtol=1e-5)


@needs_toolchain
@pytest.mark.parametrize("n", [1, 4, 37])
def test_small_row_kernel_takes_the_experts_few_rows(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert projections.native_small_linear()
    w = _weights(2, True)
    x = _rows(n, "random", w)
    expected = _reference(x, w)
    rows = record_rows(monkeypatch, "torch.ops.lorafleet.small_linear")
    torch.testing.assert_close(moe_mlp(x, w, F.silu, small_rows=projections.SMALL_LINEAR_ROWS), expected)
    counts = torch.bincount(route(x, w)[1].flatten(), minlength=EXPERTS)
    small = [c for c in counts.tolist() if 0 < c <= projections.SMALL_LINEAR_ROWS]
    assert sorted(rows) == sorted(small * 2)  # gate_up and down of each small group; the larger took F.linear
    if n == 37:
        assert len(small) < int((counts > 0).sum())


def test_router_weights_dtype_follows_the_family() -> None:
    """Mixtral keeps the top-k weights in fp32; the others cast them to the model's dtype."""
    x = torch.randn(5, HIDDEN).bfloat16()
    for fp32_weights, dtype in ((True, torch.float32), (False, torch.bfloat16)):
        w = _weights(2, True, fp32_weights)
        w.router = w.router.bfloat16()
        weights, experts = route(x, w)
        assert weights.dtype == dtype
        assert experts.shape == (5, 2)
