"""Prompt logprobs on the built-in engine (SmolLM2, fp32) against a transformers forward pass."""

import pytest
import torch

from services.worker.engine import EngineRequest, LLMEngine, RequestOutput
from services.worker.engine import prompt_logprobs as prompt_module
from services.worker.engine.model_loader import LoadedModel, load_model
from shared.schemas import SamplingParams, TokenLogprob
from tests.worker.engine.test_engine import make_engine

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "Prime numbers: 2, 3, 5, 7, 11,",
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


def ids_of(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer(text)["input_ids"]


def reference(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: position i's fp32 log-softmax, which scores token i + 1."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1)


def collect(engine: LLMEngine, arrivals: dict[int, list[EngineRequest]]) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for request in arrivals.get(step, []):
            engine.add_request(request)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
    return outputs


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def assert_matches(loaded: LoadedModel, ids: list[int], entries: list[TokenLogprob] | None, k: int) -> None:
    assert entries is not None and len(entries) == len(ids)
    assert entries[0].logprob is None and entries[0].top_logprobs == []
    assert entries[0].token == loaded.tokenizer.decode([ids[0]])
    expected = reference(loaded, ids)
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:], strict=True)):
        assert entry.logprob == pytest.approx(float(expected[position, token]), abs=1e-4)
        assert entry.token == loaded.tokenizer.decode([token])
        top = expected[position].topk(k)
        assert len(entry.top_logprobs) == k
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [loaded.tokenizer.decode([i]) for i in top.indices.tolist()]


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kwargs)


def test_prompt_logprobs_equal_transformers_and_leave_batch_neighbours_alone(loaded: LoadedModel) -> None:
    """A running decode, a plain prefill and two scored prefills (k = 5 and k = 0) share steps."""
    a, b = (ids_of(loaded, t) for t in TEXTS)
    alone = collect(make_engine(loaded), {0: [EngineRequest("plain", b, greedy())]})
    scored_alone = collect(make_engine(loaded), {0: [EngineRequest("s", a, greedy())]})
    engine = make_engine(loaded)
    outputs = collect(
        engine,
        {
            0: [EngineRequest("early", a, greedy())],
            2: [
                EngineRequest("plain", b, greedy()),
                EngineRequest("s5", a, greedy(prompt_logprobs=5)),
                EngineRequest("s0", b, greedy(prompt_logprobs=0, logprobs=True)),
            ],
        },
    )
    assert tokens_of(outputs["plain"]) == tokens_of(alone["plain"])
    assert tokens_of(outputs["early"]) == tokens_of(outputs["s5"]) == tokens_of(scored_alone["s"])
    assert_matches(loaded, a, outputs["s5"][0].prompt_logprobs, 5)
    assert_matches(loaded, b, outputs["s0"][0].prompt_logprobs, 0)
    assert all(out.prompt_logprobs is None for out in outputs["s5"][1:] + outputs["plain"] + outputs["early"])
    assert outputs["s0"][0].token_logprobs is not None  # output logprobs still come alongside
    assert engine.blocks.allocator.num_free == engine.num_blocks


def test_a_prompt_in_the_prefix_cache_is_recomputed_for_its_logprobs(loaded: LoadedModel) -> None:
    """The cached positions have no logits: a scored prompt bypasses the cache, and what it writes
    is still shared with the plain requests after it."""
    ids = ids_of(loaded, TEXTS[0])
    engine = make_engine(loaded, kv_block_size=8, enable_prefix_caching=True)
    warm = collect(engine, {0: [EngineRequest("warm", ids, greedy())]})
    hits = engine.blocks.hit_tokens
    scored = collect(engine, {0: [EngineRequest("scored", ids, greedy(prompt_logprobs=3))]})
    assert engine.blocks.hit_tokens == hits
    assert_matches(loaded, ids, scored["scored"][0].prompt_logprobs, 3)
    again = collect(engine, {0: [EngineRequest("again", ids, greedy())]})
    assert engine.blocks.hit_tokens >= hits + 8 * ((len(ids) - 1) // 8) > hits
    assert tokens_of(again["again"]) == tokens_of(scored["scored"]) == tokens_of(warm["warm"])


def test_long_prompts_are_scored_chunk_by_chunk(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_module, "ROWS_PER_CHUNK", 7)
    ids = ids_of(loaded, TEXTS[0])
    assert len(ids) > 2 * 7
    outputs = collect(make_engine(loaded), {0: [EngineRequest("long", ids, greedy(prompt_logprobs=2))]})
    assert_matches(loaded, ids, outputs["long"][0].prompt_logprobs, 2)


def test_a_preempted_request_reports_its_prompt_once(loaded: LoadedModel) -> None:
    """KV for about one sequence: the second is preempted and re-prefilled with its output so far."""
    a, b = (ids_of(loaded, t) for t in TEXTS)
    engine = make_engine(loaded, num_blocks=4, kv_block_size=16)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    preempted: list[str] = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq, out: preempted.append(seq.request_id) or preempt(seq, out)  # type: ignore[method-assign]
    outputs = collect(engine, {0: [EngineRequest("a", a, params), EngineRequest("b", b, params)]})
    for rid, ids in (("a", a), ("b", b)):
        assert len(tokens_of(outputs[rid])) == 30
        assert_matches(loaded, ids, outputs[rid][0].prompt_logprobs, 1)
        assert all(out.prompt_logprobs is None for out in outputs[rid][1:])
    assert preempted
