"""The native layer loop (kernels/csrc/decoder_stack.cpp through engine/layer_loop.py): a decode step's
logits and K/V cache equal the Python loop's bit for bit, for every family (windows, soft-caps,
Gemma's extra norms and local RoPE, Qwen3's and Gemma 3's q/k head norms, Granite's multipliers,
Qwen2's biases, Phi-3), fp32
and bf16, at row counts on both sides of the small-row kernel, with mixed-rank LoRA adapters, and on
weight-only int8 and int4 projections; which
steps and models it takes; and what its constructor and LoRA layout refuse."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels import native, projections
from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.batch import StepBatch, build_batch
from services.worker.engine.kv_cache import BlockManager, KVCache
from services.worker.engine.layer_loop import NativeLayerLoop
from services.worker.engine.linear import AMX_SMALL_ROWS, DOT_SMALL_ROWS, CpuLinear, LinearFactory, onednn_usable
from services.worker.engine.lora_hook import BgmvCalls, LoraHook
from services.worker.engine.model import LlamaForward
from services.worker.engine.quant import WeightFormat
from services.worker.engine.sequence import Sequence
from services.worker.engine.weights import ModelWeights, load_weights
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from shared.schemas import SamplingParams
from tests.helpers.adapters import ALL_MODULES, make_peft_model, tiny_llama, tiny_llama_config
from tests.helpers.families import FAMILIES, PROMPTS, word_tokenizer
from tests.helpers.native import needs_toolchain

pytestmark = needs_toolchain
BLOCK = 4
MAX_LEN = 96


def _forward(weights: ModelWeights, linear: CpuLinear, loop: bool, quant: WeightFormat = "none") -> LlamaForward:
    assert native.native_decode() and native.native_layer_ops()
    factory = LinearFactory(linear, "cpu", weights.embed.dtype, quant)
    return LlamaForward(weights, factory, native_attention=True, native_layer_ops=True, native_layer_loop=loop)


class _Pair:
    """The same model with and without the native loop, each with its own cache, fed the same steps."""

    def __init__(self, weights: ModelWeights, linear: CpuLinear = "panel", quant: WeightFormat = "none"):
        self.native, self.python = _forward(weights, linear, True, quant), _forward(weights, linear, False, quant)
        assert self.python.loop is None
        dtype = weights.embed.dtype
        self.caches = [KVCache(weights.spec, 96, BLOCK, dtype, "cpu") for _ in range(2)]
        self.blocks = BlockManager(96, BLOCK)
        self.loop_calls = 0

    def step(
        self,
        decodes: list[Sequence],
        prefills: list[Sequence],
        lora: LoraHook | Callable[[StepBatch], LoraHook] | None = None,
    ) -> torch.Tensor:
        """One step through both (``lora`` a hook, or what makes one of the step's batch)."""
        for seq in decodes:
            self.blocks.append(seq)
        for seq in prefills:
            self.blocks.allocate(seq)
        batch = build_batch(decodes, prefills, BLOCK, "cpu")
        if callable(lora):
            lora = lora(batch)
        logits = [
            self._logits(model, batch, cache, lora)
            for model, cache in zip((self.native, self.python), self.caches, strict=True)
        ]
        assert torch.equal(logits[0], logits[1]), (logits[0] - logits[1]).abs().max()
        assert torch.equal(self.caches[0].data, self.caches[1].data)
        for row, seq in enumerate(batch.seqs):
            seq.num_cached = seq.num_tokens
            seq.token_ids.append(int(logits[1][row].argmax()))
        return logits[1]

    def _logits(self, model: LlamaForward, batch: StepBatch, cache: KVCache, lora: LoraHook | None) -> torch.Tensor:
        loop = model.loop
        if loop is not None:  # count the steps the native loop serves
            real = loop.__call__

            def counted(*args: object) -> torch.Tensor:
                self.loop_calls += 1
                return real(*args)  # type: ignore[arg-type]

            model.loop = counted  # type: ignore[assignment]
        try:
            return model.forward(batch.input_ids, batch.positions, batch.meta, cache, batch.logits_indices, lora)
        finally:
            model.loop = loop


def _sequences(count: int) -> list[Sequence]:
    prompts = [PROMPTS[i % len(PROMPTS)][: 3 + i] for i in range(count)]
    return [Sequence(EngineRequest(str(i), list(p)), None) for i, p in enumerate(prompts)]  # type: ignore[arg-type]


def _decode_rounds(pair: _Pair, seqs: list[Sequence]) -> None:
    """Prefill all (the Python loop in both), then decode steps of every row count in ROWS, past the
    windows of the windowed families."""
    pair.step([], seqs)
    assert pair.loop_calls == 0
    for rows in ROWS:
        pair.step(seqs[:rows], [])
    assert pair.loop_calls == len(ROWS)


ROWS = (9, 1, 3, 5, 9, 2, 8, 9, 4, 1, 9)  # crosses the small-row kernel's 4 and 8, the panel tile's 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_decode_steps_equal_the_python_loop(family: str, dtype: torch.dtype) -> None:
    weights = load_weights(FAMILIES[family](), dtype, "cpu", MAX_LEN)
    pair = _Pair(weights)
    assert pair.native.loop is not None
    _decode_rounds(pair, _sequences(9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama-head-dim", "qwen2-window-8-second-layer", "gemma2-window-8-softcaps"])
def test_int8_decode_steps_equal_the_python_loop(family: str, dtype: torch.dtype) -> None:
    """Weight-only int8: up to eight rows the native int8 kernel, past them torch's bf16 kernel or the
    weight dequantized per call (fp32), in the loop as in QuantWeight."""
    assert projections.native_small_linear_int8()
    weights = load_weights(FAMILIES[family](), dtype, "cpu", MAX_LEN)
    pair = _Pair(weights, "auto", "int8")
    assert pair.native.loop is not None and pair.native.proj[0]["qkv"].path == "int8"
    _decode_rounds(pair, _sequences(9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama-head-dim", "qwen2-window-8-second-layer"])
def test_int4_decode_steps_equal_the_python_loop(family: str, dtype: torch.dtype) -> None:
    """Weight-only int4 (groups of 32): fp32 up to eight rows on the native int4 kernel, past them the
    weight dequantized per call; bf16 on torch's int4 kernel at every row count; in the loop as in
    QuantWeight."""
    assert projections.native_small_linear_int4()
    weights = load_weights(FAMILIES[family](), dtype, "cpu", MAX_LEN)
    pair = _Pair(weights, "auto", "int4")
    quant = pair.native.proj[0]["qkv"].quant
    assert pair.native.loop is not None and quant is not None and quant.format == "int4"
    assert (quant.small_rows, quant.packed is not None) == ((8, False) if dtype == torch.float32 else (0, True))
    _decode_rounds(pair, _sequences(9))


@pytest.mark.parametrize("onednn", [False, True], ids=["this-cpu", "onednn-preferred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_auto_linears_take_the_small_row_kernel_in_the_loop_too(
    dtype: torch.dtype, onednn: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` splits rows between the small-row kernel and a panel kernel or oneDNN's packed linear
    (``onednn-preferred``: a CPU whose panel kernels fail their probes); the loop splits them alike,
    oneDNN's rows padded as ``Linear`` pads them. Only where neither is usable is no stack built."""
    if onednn:
        monkeypatch.setattr(projections, "panel_linear_preferred", lambda: False)
        monkeypatch.setattr(projections, "native_panel_dot", lambda: False)
        monkeypatch.setattr(projections, "native_panel_wide", lambda: False)
    weights = load_weights(FAMILIES["gemma2-window-8-softcaps"](), dtype, "cpu", MAX_LEN)
    factory = LinearFactory("auto", "cpu", dtype)
    pair = _Pair(weights, "auto")
    if factory.path == "torch":
        assert pair.native.loop is None
        return
    assert pair.native.loop is not None
    assert pair.native.proj[0]["qkv"].small_rows == factory.small_rows
    _decode_rounds(pair, _sequences(9))


needs_onednn_bf16 = pytest.mark.skipif(not onednn_usable(torch.bfloat16), reason="no oneDNN bf16 GEMM on this CPU")


@needs_onednn_bf16
@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_bf16_on_amx_takes_onednn_past_the_small_rows_in_the_loop_too(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 ``auto`` on a CPU with AMX: oneDNN's packed linear past AMX_SMALL_ROWS rows, not the
    dot-product panel kernel, in the native loop as in Python (equal bit for bit at rows on both sides);
    without AMX the dot-product kernel where it is built."""
    monkeypatch.setattr(projections, "amx_bf16", lambda: amx)
    factory = LinearFactory("auto", "cpu", torch.bfloat16)
    if amx:
        assert (factory.path, factory.small_rows) == ("onednn", AMX_SMALL_ROWS)
    elif projections.native_panel_dot():
        assert (factory.path, factory.small_rows) == ("dot", DOT_SMALL_ROWS)
    weights = load_weights(FAMILIES["qwen3-qk-norm"](), torch.bfloat16, "cpu", MAX_LEN)
    pair = _Pair(weights, "auto")
    assert pair.native.loop is not None
    if amx:
        assert pair.native.proj[0]["qkv"].path == "onednn"
    pair.step([], seqs := _sequences(9))
    for rows in (9, 7, 8, 1, 9):  # oneDNN pads 9 rows to 16 and 8 runs unpadded
        pair.step(seqs[:rows], [])
    assert pair.loop_calls == 5


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)], ids=["fp32", "bf16"]
)
def test_onednn_mode_runs_in_the_loop(dtype: torch.dtype) -> None:
    """``onednn``: every row count through oneDNN's packed linear, in the native loop as in Python."""
    pair = _Pair(load_weights(FAMILIES["llama-head-dim"](), dtype, "cpu", MAX_LEN), "onednn")
    assert pair.native.loop is not None
    _decode_rounds(pair, _sequences(9))


def _manager(dtype: torch.dtype) -> AdapterManager:
    return AdapterManager(
        LoraConfig(memory_budget_bytes=2**24, rank_classes=(8, 64)),
        ModelShapes.from_hf_config(tiny_llama_config()),
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_decodes_equal_the_python_loop(tmp_path: Path, dtype: torch.dtype) -> None:
    """Adapters of two rank classes (q,v at rank 8; all seven at rank 64, rsLoRA) beside base rows."""
    base = tiny_llama()
    manager = _manager(dtype)
    specs = {"a8": (8, 16, ("q_proj", "v_proj"), False), "b64": (64, 32, ALL_MODULES, True)}
    for seed, (name, (rank, alpha, modules, rslora)) in enumerate(specs.items()):
        model = make_peft_model(base, rank=rank, alpha=alpha, target_modules=modules, use_rslora=rslora, seed=seed)
        model.save_pretrained(tmp_path / name)
        manager.load_adapter(name, tmp_path / name)
    pair = _Pair(load_weights(base, dtype, "cpu", MAX_LEN))
    seqs = _sequences(7)
    names = ["a8", None, "b64", "a8", "b64", None, "b64"]
    for seq, name in zip(seqs, names, strict=True):
        seq.slot = -1 if name is None else manager.slot_of(name)

    def prepare(batch: StepBatch) -> LoraHook:
        lora = manager.prepare(batch.token_slots)
        assert lora is not None and (batch.meta.prefill_bounds or lora.bgmv_calls(dtype) is not None)
        return lora

    def step(decodes: list[Sequence], prefills: list[Sequence]) -> None:
        pair.step(decodes, prefills, prepare)

    step([], seqs)
    for rows in (7, 1, 3, 6, 7):
        step(seqs[:rows], [])
    assert pair.loop_calls == 5


class _OtherPath:
    """A LoRA hook whose deltas are not lora_bgmv calls: the forward must take the Python loop."""

    ranks = (8,)
    groups = frozenset({"o"})

    def __init__(self) -> None:
        self.applied: list[tuple[int, str]] = []

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.applied.append((layer, group))
        y.add_(1.0)

    def bgmv_calls(self, dtype: torch.dtype) -> BgmvCalls | None:
        return None


def test_steps_the_loop_leaves_to_python() -> None:
    weights = load_weights(FAMILIES["llama-head-dim"](), torch.float32, "cpu", MAX_LEN)
    pair = _Pair(weights)
    seqs = _sequences(3)
    pair.step([], seqs[:2])  # a prefill
    pair.step(seqs[:2], seqs[2:])  # decodes mixed with a prefill
    assert pair.loop_calls == 0
    hook = _OtherPath()
    pair.step(seqs, [], hook)  # a hook the loop cannot run
    assert pair.loop_calls == 0 and hook.applied == [(0, "o"), (1, "o")] * 2
    pair.step(seqs, [])
    assert pair.loop_calls == 1


def test_which_models_the_loop_serves() -> None:
    llama = load_weights(FAMILIES["llama-head-dim"](), torch.float32, "cpu", MAX_LEN)
    assert _forward(llama, "panel", True).loop is not None
    assert _forward(llama, "torch", True).loop is None  # F.linear has no native form
    factory = LinearFactory("panel", "cpu", torch.float32)
    eager_ops = LlamaForward(llama, factory, native_attention=True, native_layer_ops=False, native_layer_loop=True)
    assert eager_ops.loop is None
    eager_attention = LlamaForward(
        llama, factory, native_attention=False, native_layer_ops=True, native_layer_loop=True
    )
    assert eager_attention.loop is None
    forward = _forward(llama, "panel", False)
    assert NativeLayerLoop.serves(llama, forward.proj, forward.attention, True)
    forward.proj[1]["down"] = LinearFactory("torch", "cpu", torch.float32)(forward.proj[1]["down"].weight)
    assert not NativeLayerLoop.serves(llama, forward.proj, forward.attention, True)


def _engine(mode: str) -> LLMEngine:
    model = FAMILIES["llama-head-dim"]()
    config = EngineConfig(
        num_blocks=64, kv_block_size=BLOCK, max_model_len=MAX_LEN, cpu_linear="panel", cpu_layer_loop=mode
    )
    weights = load_weights(model, torch.float32, "cpu", MAX_LEN)
    return LLMEngine(weights, tokenizer=word_tokenizer(256), config=config, eos_token_ids=set())


def test_engine_setting_and_greedy_text() -> None:
    engines = {mode: _engine(mode) for mode in ("auto", "python")}
    assert engines["auto"].model.loop is not None and engines["python"].model.loop is None
    outputs = {}
    for mode, engine in engines.items():
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(EngineRequest(str(i), list(prompt), SamplingParams(max_tokens=8, temperature=0.0)))
        done: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                done.setdefault(out.request_id, []).extend(out.token_ids)
        outputs[mode] = done
    assert len(outputs["auto"]) == len(PROMPTS) and all(len(t) == 8 for t in outputs["auto"].values())
    assert outputs["auto"] == outputs["python"]


def _stack_args(layers: int = 1) -> list[object]:
    w = torch.zeros(8, 8)
    return [
        2, 1, 4, 1e-5, 1.0, False, 0, 1,
        [w] * 4 * layers, [None] * 4 * layers, [w] * 4 * layers,
        [torch.ones(8)] * layers, [torch.ones(8)] * layers, [None] * layers, [None] * layers,
        [None] * layers, False, [0] * layers, [0] * layers, [0.5] * layers, [0.0] * layers, 0,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("index", "value", "message"),
    [
        (8, [torch.zeros(8, 8)] * 3, "four projections per layer"),
        (7, 6, "unknown panel kernel"),
        (1, 3, "head counts"),
        (17, [0, 0], "one of each per layer"),
        (8, [torch.zeros(8, 8).t()] * 4, "contiguous"),
    ],
)
def test_the_stack_refuses_a_malformed_model(index: int, value: object, message: str) -> None:
    args = _stack_args()
    args[index] = value
    with pytest.raises(RuntimeError, match=message):
        torch.classes.lorafleet.DecoderStack(*args)


@pytest.mark.parametrize(
    ("tensors", "layout", "message"),
    [
        ([], [0], "layout is cut short"),
        ([], [4, 1, 0], "group or members"),
        ([], [0, 2, 0], "columns are cut short"),
        ([torch.zeros(1)] * 3, [0, 1, 0], "tensors are cut short"),
        ([torch.zeros(1)] * 6, [0, 1, 0], "past the layout"),
        ([torch.zeros(1)], [], "past the layout"),
    ],
)
def test_the_stack_refuses_a_malformed_lora_layout(
    tensors: list[torch.Tensor], layout: list[int], message: str
) -> None:
    stack = torch.classes.lorafleet.DecoderStack(*_stack_args())
    h = torch.zeros(1, 8)
    cache = torch.zeros(1, 2, 1, 4, 4)
    with pytest.raises(RuntimeError, match=message):
        stack.forward(h, h, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4), torch.zeros(1, dtype=torch.long), cache,
                      torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 4, tensors, layout)  # fmt: skip


def test_use_int4_refuses_what_does_not_fit() -> None:
    args = _stack_args()
    stack = torch.classes.lorafleet.DecoderStack(*args)
    with pytest.raises(RuntimeError, match="use_int4 on a stack of kernel 1"):
        stack.use_int4(32, [None] * 4, [None] * 4, [None] * 4)
    args[7] = 5  # kInt4
    stack = torch.classes.lorafleet.DecoderStack(*args)
    with pytest.raises(RuntimeError, match="one of each per projection"):
        stack.use_int4(32, [None] * 3, [None] * 4, [None] * 4)
    with pytest.raises(RuntimeError, match="int4 group size 0"):
        stack.use_int4(0, [None] * 4, [None] * 4, [None] * 4)
    with pytest.raises(RuntimeError, match="scale and offset pairs"):
        stack.use_int4(32, [None] * 4, [torch.zeros(1)] * 4, [None] * 4)
