"""The adapter hook: per-token slots reach the manager, deltas change only adapter requests' tokens."""

from dataclasses import dataclass, field

import pytest
import torch

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.lora_hook import GROUPS
from services.worker.engine.weights import ModelWeights, load_weights
from shared.schemas import SamplingParams
from tests.helpers.families import tiny_llama

PROMPTS = {"base": [5, 6, 7, 8, 9], "a": [10, 11, 12], "b": [13, 14, 15, 16]}
RANK = 4


@dataclass
class ToyLora:
    """y += x @ A[slot] @ B[slot] for tokens with a slot; A, B per module, shared by layers."""

    slots: torch.Tensor  # [num_tokens]
    a: dict[str, torch.Tensor]  # module -> [num_slots, in, rank]
    b: dict[str, torch.Tensor]  # module -> [num_slots, rank, out]

    @property
    def ranks(self) -> tuple[int, ...]:
        return (next(iter(self.a.values())).shape[-1],)

    @property
    def groups(self) -> frozenset[str]:
        return frozenset(GROUPS)

    def apply(self, layer: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        mask = self.slots >= 0
        index = self.slots.clamp(min=0)
        deltas = [
            torch.einsum("tr,tro->to", torch.einsum("ti,tir->tr", x, self.a[module][index]), self.b[module][index])
            for module in GROUPS[group]
        ]
        y.add_(torch.cat(deltas, dim=1) * mask.unsqueeze(1))

    def bgmv_calls(self, dtype: torch.dtype) -> None:
        return None  # the toy's einsums are no lora_bgmv calls: the forward runs its Python loop


@dataclass
class ToyManager:
    resident: dict[str, int]
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]
    calls: list[list[int]] = field(default_factory=list)
    rank_classes: tuple[int, ...] = (8,)

    def slot_of(self, adapter: str) -> int | None:
        return self.resident.get(adapter)

    def prepare(self, token_slots: torch.Tensor) -> ToyLora:
        self.calls.append(token_slots.tolist())
        return ToyLora(token_slots, self.a, self.b)


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return load_weights(tiny_llama(), torch.float32, "cpu", 64)


def make_manager(weights: ModelWeights) -> ToyManager:
    spec = weights.spec
    inter = weights.layers[0].down.shape[1]
    dims = {
        "q_proj": (spec.hidden_size, spec.q_size),
        "k_proj": (spec.hidden_size, spec.kv_size),
        "v_proj": (spec.hidden_size, spec.kv_size),
        "o_proj": (spec.q_size, spec.hidden_size),
        "gate_proj": (spec.hidden_size, inter),
        "up_proj": (spec.hidden_size, inter),
        "down_proj": (inter, spec.hidden_size),
    }
    gen = torch.Generator().manual_seed(1)
    a = {m: torch.randn(2, dims[m][0], RANK, generator=gen) * 0.5 for m in dims}
    b = {m: torch.randn(2, RANK, dims[m][1], generator=gen) * 0.5 for m in dims}
    return ToyManager({"a": 0, "b": 1}, a, b)


class _NullTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x4E00 + i) for i in ids)


def run(weights: ModelWeights, manager: ToyManager | None, adapters: dict[str, str | None]) -> dict[str, list[int]]:
    config = EngineConfig(num_blocks=32, kv_block_size=4, max_model_len=64, max_num_batched_tokens=64)
    engine = LLMEngine(weights, tokenizer=_NullTokenizer(), config=config, eos_token_ids=set(), adapter_manager=manager)
    for name, ids in PROMPTS.items():
        params = SamplingParams(max_tokens=6, temperature=0.0)
        engine.add_request(EngineRequest(name, ids, params, adapter=adapters[name]))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_engine_passes_per_token_slots(weights: ModelWeights) -> None:
    manager = make_manager(weights)
    run(weights, manager, {"base": None, "a": "a", "b": "b"})
    prefill = [-1] * 5 + [0] * 3 + [1] * 4
    assert manager.calls[0] == prefill
    assert manager.calls[1] == [-1, 0, 1]
    assert len(manager.calls) == 6


def test_deltas_change_only_adapter_requests(weights: ModelWeights) -> None:
    plain = run(weights, None, {"base": None, "a": None, "b": None})
    manager = make_manager(weights)
    assert run(weights, manager, {"base": None, "a": None, "b": None}) == plain
    assert manager.calls == []
    mixed = run(weights, make_manager(weights), {"base": None, "a": "a", "b": "b"})
    assert mixed["base"] == plain["base"]
    assert mixed["a"] != plain["a"] and mixed["b"] != plain["b"]


def test_request_waits_for_its_adapter_while_others_run(weights: ModelWeights) -> None:
    manager = make_manager(weights)
    config = EngineConfig(num_blocks=32, kv_block_size=4, max_model_len=64, max_num_batched_tokens=64)
    engine = LLMEngine(weights, tokenizer=_NullTokenizer(), config=config, eos_token_ids=set(), adapter_manager=manager)
    engine.add_request(EngineRequest("late", PROMPTS["b"], SamplingParams(max_tokens=3, temperature=0.0), adapter="c"))
    engine.add_request(EngineRequest("base", PROMPTS["base"], SamplingParams(max_tokens=3, temperature=0.0)))
    first = engine.step()
    assert [o.request_id for o in first] == ["base"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["late"]
    manager.resident["c"] = 1
    second = engine.step()
    assert sorted(o.request_id for o in second) == ["base", "late"]
    assert manager.calls[-1] == [-1] + [1] * 4
