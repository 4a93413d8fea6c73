"""Engine time per request: each step's seconds split over its rows by the tokens each fed it."""

import time

import pytest

from services.worker.engine import EngineConfig, EngineRequest, LLMEngine
from services.worker.engine.engine import step_shares
from services.worker.engine.model_loader import LoadedModel, load_model
from shared.schemas import SamplingParams


def test_prefill_and_decode_shares_sum_to_the_step_time() -> None:
    prefill, decode = step_shares(0.030, [5, 1])
    assert prefill + decode == pytest.approx(0.030)
    assert prefill == pytest.approx(5 * decode)
    assert step_shares(0.01, []) == []


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


def test_a_mixed_step_charges_the_prefill_by_its_prompt_and_the_decode_one_token(loaded: LoadedModel) -> None:
    config = EngineConfig(kv_cache_bytes=64 * 2**20, max_model_len=256, max_num_batched_tokens=512)
    engine = LLMEngine.from_loaded(loaded, config)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first_prompt, second_prompt = list(range(100, 112)), list(range(200, 207))
    began = time.perf_counter()
    engine.add_request(EngineRequest("a", first_prompt, greedy))
    (first,) = engine.step()  # a's prefill alone: the whole step is its
    assert first.engine_s is not None and first.engine_s > 0
    engine.add_request(EngineRequest("b", second_prompt, greedy))
    mixed = {out.request_id: out for out in engine.step()}  # a decodes one token, b prefills 7
    a_share = mixed["a"].engine_s - first.engine_s  # type: ignore[operator]
    b_share = mixed["b"].engine_s
    assert b_share is not None and a_share > 0
    assert b_share == pytest.approx(len(second_prompt) * a_share)
    finals: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.engine_s is not None
            if out.finished:
                finals[out.request_id] = out.engine_s
    elapsed = time.perf_counter() - began
    assert finals.keys() == {"a", "b"}
    assert finals["a"] > first.engine_s and finals["b"] > b_share
    assert sum(finals.values()) <= elapsed  # the steps' time split, never counted twice
