"""The native paged decode-attention kernel (kernels/native.py) against the eager decode path it
replaces: the same outputs over scattered block tables, every head_dim path (64 and 128 unrolled,
any other at run time), GQA groups, sliding windows, Gemma 2's soft-cap, fp32 and bf16; its input
checks; the engine's choice (``cpu_attention``); and an engine's greedy tokens, native against eager."""

import pytest
import torch

from kernels.native import native_decode, paged_decode
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.attention import AttentionMetadata, AttentionParams, paged_attention, use_native_decode
from services.worker.engine.weights import load_weights
from shared.schemas import SamplingParams
from tests.helpers.families import NullTokenizer, tiny_llama
from tests.helpers.native import needs_toolchain

pytestmark = needs_toolchain

BLOCK = 16
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def test_it_builds_and_passes_its_probe() -> None:
    """With an x86-64 g++ (and the ninja wheel, a dependency) a failed build or probe is a defect."""
    assert native_decode()


def _decode_case(
    lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, a cache holding every decode's context on blocks scattered over it, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(per_row) + 7
    cache = torch.randn(2, kv_heads, num_blocks * BLOCK, head_dim, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    width = max(per_row)
    tables = [[free.pop() for _ in range(blocks)] + [0] * (width - blocks) for blocks in per_row]
    n = len(lengths)
    lens = torch.tensor(lengths)
    mask = (torch.arange(width * BLOCK)[None, :] < lens[:, None]).view(1, n, 1, width * BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        num_decode=n,
        decode_blocks=torch.tensor(tables).view(-1),
        decode_mask=mask,
        decode_lengths=lens,
        prefill_bounds=[],
    )
    # q as the engine passes it: a view of the rotated q/k heads, rows strided past the k heads
    qk = torch.randn(n, heads + kv_heads, head_dim, generator=g).to(dtype)
    return qk[:, :heads], cache, meta


def _both(
    q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, params: AttentionParams
) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, head_dim = q.shape
    kv = q.new_empty(n, cache.shape[1], head_dim)  # this step's K/V: already in the cache, unused by decodes
    outputs = []
    for native in (False, True):
        layer = AttentionParams(params.scale, params.window, params.softcap, native)
        outputs.append(paged_attention(q, kv, kv, cache, meta, BLOCK, q.new_empty(n, heads * head_dim), layer).clone())
    return outputs[0], outputs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(9, 3, 64), (8, 2, 128), (4, 4, 24), (6, 1, 256)],
    ids=["smollm2-64", "gqa4-128", "mha-24", "mqa-256"],
)
def test_native_decodes_match_the_eager_path(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    lengths = [1, 16, 17, 47, 130, 5]  # one token, exactly a block, a block and one, several blocks
    q, cache, meta = _decode_case(lengths, heads, kv_heads, head_dim, dtype, seed=head_dim)
    eager, native = _both(q, cache, meta, AttentionParams(head_dim**-0.5))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(native.float(), eager.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("window", "softcap"), [(8, None), (20, None), (None, 3.0), (8, 3.0)])
def test_windows_and_the_soft_cap_match_the_eager_path(
    window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    lengths = [3, 8, 9, 40, 77]  # shorter than, equal to, and past the window
    q, cache, meta = _decode_case(lengths, 8, 4, 16, dtype, seed=3)
    eager, native = _both(q, cache, meta, AttentionParams(0.2, window, softcap))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(native.float(), eager.float(), atol=tol, rtol=tol)


def test_a_window_hides_what_lies_before_it() -> None:
    """With a window of 8, changing the cached K/V outside the last 8 positions changes nothing."""
    q, cache, meta = _decode_case([30], 4, 2, 16, torch.float32, seed=4)
    out = q.new_empty(1, 64)
    tables, lengths = meta.decode_blocks.view(1, -1), meta.decode_lengths
    paged_decode(q, cache, tables, lengths, out, BLOCK, 0.25, window=8)
    first, second = int(tables[0, 0]), int(tables[0, 1])
    changed = cache.clone()
    changed[:, :, first * BLOCK : (first + 1) * BLOCK] += 5.0  # positions 0..15
    changed[:, :, second * BLOCK : second * BLOCK + 6] += 5.0  # positions 16..21; the window is 22..29
    again = q.new_empty(1, 64)
    paged_decode(q, changed, tables, lengths, again, BLOCK, 0.25, window=8)
    assert torch.equal(out, again)
    paged_decode(q, changed, tables, lengths, again, BLOCK, 0.25)  # no window: every position counts
    assert not torch.equal(out, again)


def test_the_kernel_refuses_inputs_it_cannot_serve() -> None:
    q, cache, meta = _decode_case([5, 9], 4, 2, 16, torch.float32, seed=5)
    tables, lengths = meta.decode_blocks.view(2, -1), meta.decode_lengths
    with pytest.raises(RuntimeError, match="out must be"):
        paged_decode(q, cache, tables, lengths, q.new_empty(2, 63), BLOCK, 0.25)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode(q, cache.double(), tables, lengths, q.new_empty(2, 64), BLOCK, 0.25)
    with pytest.raises(RuntimeError, match="tables must be"):
        paged_decode(q, cache, tables.int(), lengths, q.new_empty(2, 64), BLOCK, 0.25)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        half = q.half()
        paged_decode(half, cache.half(), tables, lengths, half.new_empty(2, 64), BLOCK, 0.25)


def test_the_engine_takes_the_kernel_where_it_applies_and_refuses_it_where_not() -> None:
    assert use_native_decode("auto", "cpu", torch.float32, 64)
    assert use_native_decode("native", "cpu", torch.bfloat16, 256)
    assert not use_native_decode("torch", "cpu", torch.float32, 64)
    assert not use_native_decode("auto", "cpu", torch.float16, 64)  # fp16: the eager path
    assert not use_native_decode("auto", "cpu", torch.float32, 512)  # past the kernel's head_dim
    assert not use_native_decode("auto", "cuda", torch.float32, 64)
    for device, dtype, head_dim in (
        ("cpu", torch.float16, 64),
        ("cpu", torch.float32, 512),
        ("cuda", torch.float32, 64),
    ):
        with pytest.raises(ValueError, match="cpu_attention='native' is not usable"):
            use_native_decode("native", device, dtype, head_dim)


def test_an_engine_decodes_the_same_tokens_natively_and_eagerly() -> None:
    model = tiny_llama()
    tokens = {}
    for mode in ("torch", "native"):
        config = EngineConfig(
            kv_cache_bytes=2**20, max_model_len=128, kv_block_size=4, cpu_attention=mode, enable_prefix_caching=False
        )
        engine = LLMEngine(load_weights(model, torch.float32, "cpu", 128), NullTokenizer(), config, set())  # type: ignore[arg-type]
        assert all(layer.native == (mode == "native") for layer in engine.model.attention)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = [[5, 9, 2], list(range(1, 30)), [7] * 11]  # decodes of different lengths share each step
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", prompt, params))
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for result in engine.step():
                out[result.request_id] += result.token_ids
        tokens[mode] = out
    assert tokens["native"] == tokens["torch"]
    assert all(len(ids) == 40 for ids in tokens["native"].values())
