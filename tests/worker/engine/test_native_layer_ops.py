"""kernels/native.py's fused layer ops (RMSNorm, the residual add with the next RMSNorm, RoPE with the
K/V cache write, the gated MLP's activation) and its argmax against the eager ops they replace: values
rounded where the eager ops round them (RoPE and the residual stream bit for bit; the norms up to the
order of an fp32 sum; the activation within a few ulp of an fp64 reference; argmax exactly), q/k
views of a fused qkv output, scattered cache slots, fp32 and bf16, Gemma's fp32 norm weight and GELU,
Granite's residual multiplier; their input checks; the engine's choice (``cpu_layer_ops``); and an
engine's greedy tokens, native against eager."""

import pytest
import torch
import torch.nn.functional as F

from kernels import native
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.attention import write_kv
from services.worker.engine.model import use_native_layer_ops
from services.worker.engine.rope import apply_rope, cos_sin_table, rope_factors
from services.worker.engine.weights import load_weights
from shared.schemas import SamplingParams
from tests.helpers.families import FAMILIES, NullTokenizer, tiny_llama
from tests.helpers.native import needs_toolchain

pytestmark = needs_toolchain

DTYPES = [torch.float32, torch.bfloat16]
NORM_TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (0.0, 2**-7)}  # one bf16 step at most


def test_they_build_and_pass_their_probe() -> None:
    assert native.native_layer_ops()


@pytest.mark.parametrize("d", [576, 64, 7, 2048])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_torch(d: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(37, d + 3, generator=g) * 3).to(dtype)[:, 3:]  # rows strided past 3 columns
    weight = torch.randn(d, generator=g).to(dtype)
    atol, rtol = NORM_TOLERANCE[dtype]
    got = native.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, F.rms_norm(x, (d,), weight, 1e-5), atol=atol, rtol=rtol)
    wide = 1 + torch.randn(d, generator=g)  # Gemma: an fp32 (1 + w), the norm in fp32, one rounding
    want = F.rms_norm(x.float(), (d,), wide, 1e-5).to(dtype)
    torch.testing.assert_close(native.rms_norm(x, wide, 1e-5), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("residual_mul", [1.0, 0.22])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_updates_the_residual_stream_as_the_eager_ops_do(residual_mul: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(9, 576, generator=g).to(dtype)
    delta = torch.randn(9, 600, generator=g).to(dtype)[:, 24:]  # a strided delta (a column view)
    weight = torch.randn(576, generator=g).to(dtype)
    want_h = h + delta * residual_mul if residual_mul != 1.0 else h + delta
    got = native.add_rms_norm(h, delta, weight, 1e-6, residual_mul)
    assert torch.equal(h, want_h)  # in place, each product and sum rounded as torch rounds it
    atol, rtol = NORM_TOLERANCE[dtype]
    torch.testing.assert_close(got, F.rms_norm(want_h, (576,), weight, 1e-6), atol=atol, rtol=rtol)


@pytest.mark.parametrize("head_dim", [64, 24, 128, 80, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_write_kv_rotates_in_place_and_writes_the_cache(head_dim: int, dtype: torch.dtype) -> None:
    """q and k as the engine passes them (views of the fused qkv rows): rotated bit-identically to
    apply_rope (head_dim a multiple of 16 on the vector path, 24 on the scalar one), and K (rotated)
    and V written to the tokens' scattered slots, nothing else touched."""
    g = torch.Generator().manual_seed(head_dim)
    n, heads, kv_heads = 11, 6, 2
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    table = cos_sin_table(inv_freq, 64, dtype, "cpu")
    positions = torch.randint(0, 64, (n,), generator=g)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)
    slots = torch.randperm(40, generator=g)[:n]
    cache = torch.randn(2, kv_heads, 40, head_dim, generator=g).to(dtype)
    want_qk = apply_rope(qk, *rope_factors(table[positions]))
    want_cache = cache.clone()
    write_kv(want_cache, want_qk[:, heads:], v, slots)
    native.rope_write_kv(qk, v, table[positions], slots, cache)
    assert torch.equal(qk, want_qk)
    assert torch.equal(cache, want_cache)


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in fp32 units in the last place (both fp32; signs ordered across zero)."""
    a, b = got.view(torch.int32).long(), want.view(torch.int32).long()
    a = torch.where(a < 0, -(a & 0x7FFFFFFF), a)
    b = torch.where(b < 0, -(b & 0x7FFFFFFF), b)
    return (a - b).abs()


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_act_mul_is_within_a_few_ulp_of_the_exact_activation(gelu: bool) -> None:
    g = torch.Generator().manual_seed(3)
    gate = torch.cat([torch.linspace(-30, 30, 40_001), torch.randn(20_003, generator=g) * 4])  # a tail past 8
    up = torch.randn(gate.numel(), generator=g)
    rows = 7
    gate, up = gate[: gate.numel() // rows * rows].view(rows, -1), up[: gate.numel() // rows * rows].view(rows, -1)
    got = native.act_mul(torch.cat([gate, up], 1), gelu)
    assert got.shape == gate.shape and got.is_contiguous()
    x = gate.double()
    # GELU-tanh's 0.5 x (1 + tanh y) is x * sigmoid(2y): in fp64 the form without cancellation
    exact = x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3)) if gelu else x * torch.sigmoid(x)
    act = got / up  # the activation back out of the product, within an ulp of the rounded product
    ok = exact.abs() > 1e-30
    # SiLU: exp within 2 ulp, the division and the product one rounding each. GELU: y itself carries
    # fp32's rounding into an exp of up to ~90, as torch's does (its tanh form is far worse there)
    assert int(_ulps(act[ok], exact.float()[ok]).max()) <= (6 if not gelu else 200)
    eager = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_act_mul_rounds_bf16_as_the_eager_ops_and_keeps_specials(gelu: bool) -> None:
    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(33, 2 * 1541, generator=g) * 4).to(torch.bfloat16)
    eager_act = (lambda t: F.gelu(t, approximate="tanh")) if gelu else F.silu
    want = eager_act(gate_up[:, :1541]) * gate_up[:, 1541:]
    got = native.act_mul(gate_up, gelu)
    assert got.dtype == torch.bfloat16
    # one bf16 step where the fp32 activation falls near a rounding boundary, exact elsewhere; GELU
    # also differs absolutely on its tiny negative tail, where torch's 1 + tanh y cancels to ~0
    assert float((got == want).float().mean()) > 0.8
    torch.testing.assert_close(got, want, atol=1e-5 if gelu else 0.0, rtol=2**-7)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 95.0, -95.0, -110.0, 1e-30])
    rows = torch.stack([specials, torch.ones_like(specials)]).reshape(1, -1)  # [gate | up] of one row
    got, want = native.act_mul(rows, gelu)[0], eager_act(specials)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])  # inf stays inf, overflow gives -0 as eager


def test_argmax_is_torchs_on_ties_nan_and_minus_inf_rows() -> None:
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        rows, n = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 3000, (1,), generator=g))
        x = torch.randint(-4, 4, (rows, n), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[torch.rand(rows, n, generator=g) < 0.01] = float("nan")
        if trial % 4 == 0:
            x[0] = float("-inf")
        if trial % 5 == 0:
            x[-1, : n // 2] = -0.0  # -0 and +0 are equal maxima: the first wins
            x[-1, n // 2 :] = 0.0
        assert torch.equal(native.argmax(x), x.argmax(-1)), trial
    wide = torch.randn(90, 49_152, generator=g)[::3]  # strided rows of a vocabulary's width
    assert torch.equal(native.argmax(wide), wide.argmax(-1))
    # what it does not serve goes to torch
    for other in (wide.double(), wide.t(), wide[0]):
        assert torch.equal(native.argmax(other), other.argmax(-1))


def test_they_refuse_inputs_they_cannot_serve() -> None:
    x, w = torch.randn(3, 8), torch.randn(8)
    for args in (
        (x.double(), w.double()),  # dtype
        (x, w[:4]),  # weight size
        (x.t().contiguous().t(), w),  # strided columns
        (x.to(torch.bfloat16), w.half()),  # weight neither fp32 nor x's dtype
    ):
        with pytest.raises(RuntimeError):
            native.rms_norm(*args, 1e-6)
    with pytest.raises(RuntimeError, match="delta"):
        native.add_rms_norm(x, torch.randn(3, 9), w, 1e-6)
    qk, v, cos_sin = torch.randn(2, 3, 8), torch.randn(2, 1, 8), torch.randn(2, 2, 8)
    cache = torch.zeros(2, 1, 4, 8)
    native.rope_write_kv(qk, v, cos_sin, torch.tensor([0, 3]), cache)  # the valid call
    for bad in (
        (qk, v, cos_sin, torch.tensor([0, 4]), cache),  # slot out of range
        (qk, v, cos_sin, torch.tensor([0, 1], dtype=torch.int32), cache),  # int32 slots
        (qk, v, cos_sin[:, :1], torch.tensor([0, 1]), cache),  # cos_sin shape
        (qk, v.double(), cos_sin, torch.tensor([0, 1]), cache),  # mixed dtypes
        (
            torch.randn(2, 3, 7),
            torch.randn(2, 1, 7),
            torch.randn(2, 2, 7),
            torch.tensor([0, 1]),
            torch.zeros(2, 1, 4, 7),
        ),
    ):
        with pytest.raises(RuntimeError):
            native.rope_write_kv(*bad)
    for bad_gate_up in (torch.randn(3, 7), torch.randn(3, 8).double(), torch.randn(8, 3).t(), torch.randn(8)):
        with pytest.raises(RuntimeError):
            native.act_mul(bad_gate_up, False)
    for bad_logits in (torch.randn(3, 0), torch.randn(3, 5).to(torch.bfloat16)):
        with pytest.raises(RuntimeError):
            torch.ops.lorafleet.argmax_rows(bad_logits)


def test_the_engine_takes_them_where_they_apply_and_refuses_them_where_not() -> None:
    assert use_native_layer_ops("auto", "cpu", torch.float32)
    assert use_native_layer_ops("native", "cpu", torch.bfloat16)
    assert not use_native_layer_ops("torch", "cpu", torch.float32)
    assert not use_native_layer_ops("auto", "cpu", torch.float16)
    assert not use_native_layer_ops("auto", "cuda", torch.float32)
    for device, dtype in (("cpu", torch.float16), ("cuda", torch.float32)):
        with pytest.raises(ValueError, match="cpu_layer_ops='native' is not usable"):
            use_native_layer_ops("native", device, dtype)


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_an_engine_decodes_the_same_tokens_with_fused_and_eager_layer_ops(gelu: bool) -> None:
    model = FAMILIES["gemma2-window-8-softcaps"]() if gelu else tiny_llama()  # Gemma 2: GELU-tanh
    tokens = {}
    for mode in ("torch", "native"):
        config = EngineConfig(
            kv_cache_bytes=2**20, max_model_len=128, kv_block_size=4, cpu_layer_ops=mode, enable_prefix_caching=False
        )
        engine = LLMEngine(load_weights(model, torch.float32, "cpu", 128), NullTokenizer(), config, set())  # type: ignore[arg-type]
        assert engine.model.native == (mode == "native")
        assert engine.model._gelu == gelu
        assert (engine._argmax is not None) == (mode == "native")
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = [[5, 9, 2], list(range(1, 30)), [7] * 11]
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", prompt, params))
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for result in engine.step():
                out[result.request_id] += result.token_ids
        tokens[mode] = out
    assert tokens["native"] == tokens["torch"]
    assert all(len(ids) == 40 for ids in tokens["native"].values())
