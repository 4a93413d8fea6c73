"""The engine on SmolLM2: greedy equals transformers generate, continuous batching, KV exhaustion, stops."""

import pytest
import torch

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine, RequestTooLarge
from services.worker.engine.model_loader import LoadedModel, load_model
from shared.schemas import SamplingParams

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write one sentence about the sea, in the voice of an old sailor who has seen too many storms.",
    "List two prime numbers.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    return [
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone through transformers greedy generate, stopping at EOS."""
    out = []
    for ids in prompts:
        with torch.no_grad():
            generated = loaded.model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(generated[0, len(ids) :].tolist())
    return out


def make_engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    defaults = {"kv_cache_bytes": 64 * 2**20, "max_model_len": 256, "max_num_batched_tokens": 512}
    config = EngineConfig(**{**defaults, **overrides})
    return LLMEngine.from_loaded(loaded, config)


def greedy(max_tokens: int = NEW_TOKENS, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


Results = dict[str, tuple[list[int], str, str]]


def run(engine: LLMEngine, arrivals: dict[int, list[EngineRequest]] | None = None) -> Results:
    """Step to completion, adding ``arrivals[step]`` before each step; id -> (tokens, text, finish reason)."""
    results: Results = {}
    step = 0
    while engine.has_unfinished() or (arrivals and any(k >= step for k in arrivals)):
        for request in (arrivals or {}).get(step, []):
            engine.add_request(request)
        for out in engine.step():
            tokens, text, _ = results.get(out.request_id, ([], "", ""))
            results[out.request_id] = (tokens + out.token_ids, text + out.text, out.finish_reason or "")
        step += 1
    return results


def test_greedy_batch_equals_transformers_generate(
    loaded: LoadedModel, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    engine = make_engine(loaded)
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), ids, greedy()))
    results = run(engine)
    for i, expected in enumerate(reference):
        tokens, text, reason = results[str(i)]
        assert tokens == expected
        assert text == loaded.tokenizer.decode(expected, skip_special_tokens=True)
        assert reason == ("stop" if expected[-1] == 2 else "length")
    assert engine.blocks.allocator.num_free == engine.num_blocks


def test_requests_joining_mid_flight_match_running_alone(
    loaded: LoadedModel, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    engine = make_engine(loaded)
    arrivals = {3 * i: [EngineRequest(str(i), ids, greedy())] for i, ids in enumerate(prompts)}
    results = run(engine, arrivals)
    assert [results[str(i)][0] for i in range(len(prompts))] == reference


@pytest.mark.parametrize(("prefix_caching", "num_blocks"), [(False, 40), (True, 28)])
def test_kv_exhaustion_queues_and_preempts_with_correct_tokens(
    loaded: LoadedModel, prompts: list[list[int]], reference: list[list[int]], prefix_caching: bool, num_blocks: int
) -> None:
    """With prefix caching the shared chat-template blocks save room, so a smaller cache forces the
    preemption; the recompute then finds its own published blocks."""
    engine = make_engine(loaded, kv_block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix_caching)
    preempted = []
    schedule = engine.scheduler.schedule

    def spy() -> object:
        plan = schedule()
        preempted.extend(seq.request_id for seq in plan.preempted)
        return plan

    engine.scheduler.schedule = spy
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), ids, greedy()))
    results = run(engine)
    assert preempted, "the tiny cache should have forced a preemption"
    assert [results[str(i)][0] for i in range(len(prompts))] == reference
    assert engine.blocks.allocator.num_free == num_blocks


def test_request_larger_than_the_cache_is_rejected(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    engine = make_engine(loaded, kv_block_size=4, num_blocks=20)
    with pytest.raises(RequestTooLarge, match="exceeds the whole KV cache"):
        engine.add_request(EngineRequest("big", prompts[0], greedy(max_tokens=200)))
    with pytest.raises(RequestTooLarge, match="prompt has"):
        engine.add_request(EngineRequest("long", [1] * 300, greedy()))
    assert not engine.has_unfinished()


def test_abort_frees_blocks(loaded: LoadedModel, prompts: list[list[int]]) -> None:
    engine = make_engine(loaded)
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(str(i), ids, greedy()))
    engine.step()
    assert engine.blocks.allocator.num_free < engine.num_blocks
    final = engine.abort("1")
    assert final is not None and final.finished and final.finish_reason == "abort"
    for i in (0, 2, 3):
        engine.abort(str(i))
    assert not engine.has_unfinished()
    assert engine.blocks.allocator.num_free == engine.num_blocks


def test_stop_string_cuts_text_and_max_tokens_gives_length(
    loaded: LoadedModel, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    full = loaded.tokenizer.decode(reference[1], skip_special_tokens=True)
    stop = full.split()[3]
    engine = make_engine(loaded)
    engine.add_request(EngineRequest("stop", prompts[1], greedy(stop=[stop])))
    engine.add_request(EngineRequest("len", prompts[1], greedy(max_tokens=5)))
    engine.add_request(EngineRequest("eos", prompts[0], greedy(max_tokens=40, ignore_eos=True)))
    results = run(engine)
    _tokens, text, reason = results["stop"]
    assert reason == "stop" and text == full[: full.index(stop)] and stop not in text
    assert results["len"][0] == reference[1][:5] and results["len"][2] == "length"
    assert len(results["eos"][0]) == 40 and results["eos"][2] == "length"
