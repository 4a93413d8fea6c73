"""Multi-LoRA through the engine: greedy tokens equal HF PEFT with each request's single adapter active.

Covers a mixed batch over nine random PEFT adapters (ranks 8-64, different target modules, one rsLoRA)
plus base requests, isolation between adapters sharing a prompt, and adapters joining mid-flight,
on SmolLM2 and on a tiny random Llama.
"""

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import PreTrainedModel

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.model_loader import LoadedModel, load_model
from services.worker.lora import AdapterManager, LoraConfig, ModelShapes
from shared.schemas import SamplingParams
from tests.helpers.adapters import ALL_MODULES, tiny_llama

NEW_TOKENS = 16
QV = ("q_proj", "v_proj")
# name -> (rank, alpha, target modules, rsLoRA); scale ~3, strong enough to change greedy tokens
SPECS = {
    "a8-all": (8, 24, ALL_MODULES, False),
    "a16-qv": (16, 48, QV, False),
    "a32-all": (32, 96, ALL_MODULES, False),
    "a64-qv": (64, 192, QV, False),
    "a8-attn": (8, 24, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
    "a16-mlp": (16, 48, ("gate_proj", "up_proj", "down_proj"), False),
    "a32-qv-rs": (32, 17, QV, True),
    "a64-all": (64, 192, ALL_MODULES, False),
    "a16-all-rs": (16, 12, ALL_MODULES, True),
}
QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "List two prime numbers.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Name a red fruit.",
    "Give me one tip for sleeping well.",
    "What does a lighthouse do?",
    "Say hello in Spanish.",
    "How many legs does a spider have?",
]


@dataclass
class Setup:
    """One base model: the engine's view of it, the PEFT reference holding every adapter, and prompts."""

    loaded: LoadedModel
    peft: PeftModel
    adapter_dirs: dict[str, Path]
    prompts: list[list[int]]
    solo: dict[tuple[int, str | None], list[int]] = field(default_factory=dict)
    _engine: LLMEngine | None = None

    def reference(self, prompt: int, adapter: str | None) -> list[int]:
        """Greedy tokens of HF PEFT with only ``adapter`` active (none: adapters disabled), cached."""
        key = (prompt, adapter)
        if key not in self.solo:
            ids = torch.tensor([self.prompts[prompt]])
            if adapter is not None:
                self.peft.set_adapter(adapter)
            with torch.no_grad(), self.peft.disable_adapter() if adapter is None else nullcontext():
                out = self.peft.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            self.solo[key] = out[0, ids.shape[1] :].tolist()
        return self.solo[key]

    def engine(self) -> LLMEngine:
        """One engine per model with every adapter resident, reused by the tests (it is idle between runs)."""
        if self._engine is None:
            self._engine = self._new_engine()
        assert not self._engine.has_unfinished()
        return self._engine

    def _new_engine(self) -> LLMEngine:
        config = EngineConfig(kv_cache_bytes=64 * 2**20, max_model_len=256, max_num_batched_tokens=512)
        manager = AdapterManager(pool_config(self.loaded.model), ModelShapes.from_hf_config(self.loaded.model.config))
        for name, directory in self.adapter_dirs.items():
            manager.load_adapter(name, directory)
        return LLMEngine.from_loaded(self.loaded, config, manager)


def pool_config(model: PreTrainedModel) -> LoraConfig:
    """A slot pool just big enough for SPECS: each rank class's share is its adapters' bytes."""
    ranks = (8, 16, 32, 64)
    shares = tuple(float(r * sum(spec[0] == r for spec in SPECS.values())) for r in ranks)
    per_rank = ModelShapes.from_hf_config(model.config).params_per_rank(ALL_MODULES) * 4
    return LoraConfig(
        rank_classes=ranks,
        class_shares=shares,
        memory_budget_bytes=int(sum(shares) * per_rank * 1.01),
        max_num_tokens=512,
    )


def build_setup(loaded: LoadedModel, prompts: list[list[int]], root: Path) -> Setup:
    """Random non-zero adapters added to one PeftModel on a copy of the base, saved the way users ship them."""
    peft: PeftModel | None = None
    for seed, (name, (rank, alpha, modules, rslora)) in enumerate(SPECS.items()):
        torch.manual_seed(seed)
        config = PeftLoraConfig(
            r=rank, lora_alpha=alpha, target_modules=list(modules), use_rslora=rslora, init_lora_weights=False
        )
        if peft is None:
            peft = get_peft_model(copy.deepcopy(loaded.model), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
    assert peft is not None
    peft.eval()
    peft.save_pretrained(root, selected_adapters=list(SPECS))
    return Setup(loaded, peft, {name: root / name for name in SPECS}, prompts)


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2"])
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    smol = load_model()
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "smollm2":
        prompts = [
            smol.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for q in QUESTIONS
        ]
        return build_setup(smol, prompts, root)
    tiny = LoadedModel(name="tiny-llama", model=tiny_llama(), tokenizer=smol.tokenizer, directory=root)
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in torch.randint(4, 24, (10,), generator=gen)
    ]
    return build_setup(tiny, prompts, root)


def request(prompt: int, adapter: str | None, setup: Setup, request_id: str | None = None) -> EngineRequest:
    rid = request_id or f"p{prompt}-{adapter or 'base'}"
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    return EngineRequest(rid, setup.prompts[prompt], params, adapter=adapter)


def run(engine: LLMEngine, arrivals: dict[int, list[EngineRequest]]) -> dict[str, list[int]]:
    """Step to completion, adding ``arrivals[step]`` before each step; request id -> generated tokens."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            engine.add_request(req)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return tokens


def test_mixed_batch_matches_peft_request_by_request(setup: Setup) -> None:
    names: list[str | None] = [*SPECS, None]
    requests = [request(i, name, setup) for i, name in enumerate(names)]
    out = run(setup.engine(), {0: requests})
    for i, (req, name) in enumerate(zip(requests, names, strict=True)):
        assert out[req.request_id] == setup.reference(i, name), req.request_id
    base = run(setup.engine(), {0: [request(i, None, setup) for i in range(len(SPECS))]})
    changed = [name for i, name in enumerate(SPECS) if out[f"p{i}-{name}"] != base[f"p{i}-base"]]
    assert len(changed) >= len(SPECS) - 1, f"only {changed} change the greedy output: adapters too weak to test"


def test_adapter_never_leaks_into_another_request(setup: Setup) -> None:
    names = ("a64-all", "a8-attn", None)
    together = run(setup.engine(), {0: [request(1, name, setup) for name in names]})
    for name in names:
        alone = run(setup.engine(), {0: [request(1, name, setup)]})
        key = request(1, name, setup).request_id
        assert together[key] == alone[key], key
    outputs = [together[request(1, name, setup).request_id] for name in names]
    assert len({tuple(o) for o in outputs}) == len(names), "the two adapters and the base must differ"


def test_adapters_joining_mid_flight_match_solo_runs(setup: Setup) -> None:
    names: list[str | None] = [*SPECS, None]
    joins = [0, 0, 2, 2, 5, 5, 9, 9, NEW_TOKENS + 3, 1]
    arrivals: dict[int, list[EngineRequest]] = {}
    for i, (name, step) in enumerate(zip(names, joins, strict=True)):
        arrivals.setdefault(step, []).append(request(i, name, setup))
    out = run(setup.engine(), arrivals)
    for i, name in enumerate(names):
        assert out[request(i, name, setup).request_id] == setup.reference(i, name), name


def _step_counts() -> dict[str, float]:
    """engine_step_time_ms_count by rank_mix, scraped from the exposition text."""
    from prometheus_client import REGISTRY
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name == "engine_step_time_ms_count":
                counts[sample.labels["rank_mix"]] = sample.value
    return counts


def test_each_step_is_timed_under_its_rank_mix(setup: Setup) -> None:
    before = _step_counts()
    run(setup.engine(), {0: [request(0, "a8-all", setup), request(1, "a64-qv", setup)]})
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    run(setup.engine(), {0: [EngineRequest("timed-base", setup.prompts[2], params)]})
    after = _step_counts()
    grew = {mix: after[mix] - before.get(mix, 0.0) for mix in after if after[mix] > before.get(mix, 0.0)}
    assert grew.get("r8+r64", 0) >= 1, grew  # the two adapters' steps, both classes in one batch
    assert grew.get("base", 0) == NEW_TOKENS, grew  # the base request alone: one step per token
