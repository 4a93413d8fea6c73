"""Host syncs per step: the sampler brings its results back in one transfer, a whole engine step
(schedule, batch, forward, sample, postprocess) reads the device once, and nothing is uploaded in a
way that would wait for the device.

On the CPU every read is counted through a TorchFunctionMode (tolist, item, bool(), int(), ...), as is
every upload that would be blocking on CUDA (``torch.tensor(..., device=)``, ``.to(device)`` without
``non_blocking``, indexing with a Python list): on a GPU each of them would be a host sync."""

import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, sampler
from services.worker.engine.sampler import sample
from services.worker.engine.sequence import Sequence
from services.worker.engine.weights import ModelWeights, load_weights
from services.worker.lora.metadata import LoraMetadata
from shared.schemas import SamplingParams
from tests.helpers.families import NullTokenizer, tiny_llama

READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"})


def _blocking_upload(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    if name in ("tensor", "as_tensor"):
        return kwargs.get("device") is not None
    if name == "to":
        device = kwargs.get("device") is not None or any(isinstance(a, str | torch.device) for a in args[1:])
        return device and not kwargs.get("non_blocking", False)
    if name in ("__getitem__", "__setitem__"):
        index = args[1]
        return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))
    return False


class HostReads(TorchFunctionMode):
    """Records the name of each tensor -> host read, and of each blocking upload, made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.uploads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
        if _blocking_upload(name, args, kwargs):
            self.uploads.append(name)
        return func(*args, **kwargs)


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.8, logprobs=True, top_logprobs=3),
    SamplingParams(temperature=1.1, min_p=0.05, seed=11, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, logprobs=True, logit_bias={3: 5.0}),
    SamplingParams(temperature=0.7),
]


def _seqs(params: list[SamplingParams]) -> list[Sequence]:
    return [Sequence(EngineRequest(str(i), [1, 2, 3], p), tokenizer=None) for i, p in enumerate(params)]


def test_the_sampler_reads_its_results_back_once_for_a_mixed_batch() -> None:
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(0)) * 3
    raw = logits.log_softmax(-1)
    with HostReads() as counted:
        out = sample(logits.clone(), _seqs(MIXED))
    assert counted.reads == ["tolist"]
    assert counted.uploads == []
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    for row, token in enumerate(out.tokens):
        assert out.logprobs[row] == pytest.approx(float(raw[row, token]), abs=1e-6)
    top = raw[1].topk(3)
    assert out.top_ids[1] == top.indices.tolist()
    assert out.top_logprobs[1] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.tokens[0] == int(logits[0].argmax())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_sampler_syncs_once_for_a_mixed_batch() -> None:
    logits = (torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(0)) * 3).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sample(logits, _seqs(MIXED))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs
    assert len(out.tokens) == len(MIXED)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_lora_metadata_reaches_the_device_without_a_sync() -> None:
    meta = LoraMetadata.allocate(max_tokens=16, class_first_slots=[0, 4, 6, 8], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for slots in ([5, 1, 1, -1, 4, 1, 0, 5], [-1, 7, 7, 6]):  # the second refills the host buffers
                indexes = meta.fill(torch.tensor(slots))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [str(w.message) for w in caught if "synchronizing" in str(w.message)] == []
    (only_high,) = [index for index in indexes if index is not None]
    assert only_high.token_idx.is_cuda and only_high.token_idx.tolist() == [3, 1, 2]
    assert only_high.seg_start.tolist() == [0, 1, 3]


def test_a_uniform_that_rounds_up_to_the_total_takes_the_last_token_with_probability(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sampler, "_uniforms", lambda seqs, device: torch.ones(len(seqs), dtype=torch.float64))
    probs = torch.tensor([[0.25, 0.5, 0.25, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert sampler._draw(probs, _seqs([SamplingParams()] * 3)).tolist() == [2, 1, 4]


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return load_weights(tiny_llama(), torch.float32, "cpu", 64)


def _steps(engine: LLMEngine) -> Iterator[tuple[list[str], list[str]]]:
    while engine.has_unfinished():
        with HostReads() as counted:
            engine.step()
        yield counted.reads, counted.uploads


def test_each_engine_step_reads_the_device_once(weights: ModelWeights) -> None:
    config = EngineConfig(num_blocks=32, kv_block_size=4, max_model_len=64, max_num_batched_tokens=64)
    engine = LLMEngine(weights, tokenizer=NullTokenizer(), config=config, eos_token_ids=set())
    for i, params in enumerate(MIXED):
        engine.add_request(
            EngineRequest(str(i), [5 + i, 6, 7, 8][: 2 + i % 3], params.model_copy(update={"max_tokens": 5}))
        )
    steps = list(_steps(engine))
    assert len(steps) == 5  # a prefill step, then four decode steps
    assert steps == [(["tolist"], [])] * 5
