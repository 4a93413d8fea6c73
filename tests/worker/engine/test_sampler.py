"""Sampling: seeded determinism, top-k / top-p restriction, greedy equivalences, and text deltas."""

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from services.worker.engine.detokenizer import IncrementalDetokenizer
from services.worker.engine.model_loader import load_model
from services.worker.engine.sampler import sample
from services.worker.engine.sequence import EngineRequest, Sequence
from shared.schemas import SamplingParams


def seqs(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(EngineRequest(str(i), [1], p), tokenizer=None) for i, p in enumerate(params)]


def draw(logits: torch.Tensor, params: SamplingParams, steps: int = 20) -> list[int]:
    (seq,) = seqs(params)
    return [sample(logits.clone(), [seq]).tokens[0] for _ in range(steps)]


LOGITS = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) * 3


def test_seeded_sampling_is_deterministic_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    alone = draw(LOGITS, params)
    assert alone == draw(LOGITS, params)
    assert len(set(alone)) > 1
    batched = seqs(SamplingParams(temperature=0.7, seed=9), params)
    logits = torch.cat([torch.randn(1, 1000), LOGITS])
    assert [sample(logits.clone(), batched).tokens[1] for _ in range(20)] == alone
    assert draw(LOGITS, SamplingParams(temperature=1.0, seed=1235)) != alone


@pytest.mark.parametrize("seed", [None, 7])
def test_draws_follow_the_distribution_and_never_a_token_of_probability_zero(seed: int | None) -> None:
    """Frequencies of 4,000 rows' draws at temperature 1 match the softmax within 4 standard errors;
    the tokens whose logit is -inf are never drawn (seeded rows and unseeded ones alike)."""
    logits = torch.full((1, 64), float("-inf"))
    logits[0, [3, 10, 40, 63]] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    expected = logits.softmax(-1)[0]
    rows = 4000
    batch = seqs(*[SamplingParams(temperature=1.0, seed=None if seed is None else seed + i) for i in range(rows)])
    tokens = torch.tensor(sample(logits.repeat(rows, 1), batch).tokens)
    counts = torch.bincount(tokens, minlength=64).double() / rows
    assert set(tokens.tolist()) <= {3, 10, 40, 63}
    error = (expected.double() * (1 - expected.double()) / rows).sqrt()
    assert bool(((counts - expected.double()).abs() <= 4 * error + 1e-9).all()), (counts[[3, 10, 40, 63]], expected)


def test_top_k_one_and_temperature_zero_are_greedy() -> None:
    best = int(LOGITS.argmax())
    assert set(draw(LOGITS, SamplingParams(temperature=1.5, top_k=1))) == {best}
    assert set(draw(LOGITS, SamplingParams(temperature=0.0))) == {best}


def test_top_k_and_top_p_restrict_the_support() -> None:
    top5 = set(torch.topk(LOGITS[0], 5).indices.tolist())
    assert set(draw(LOGITS, SamplingParams(temperature=2.0, top_k=5, seed=1), steps=200)) <= top5
    assert len(set(draw(LOGITS, SamplingParams(temperature=2.0, top_k=5, seed=1), steps=200))) > 1
    peaked = torch.full((1, 10), 0.0)
    peaked[0, 3] = 5.0  # p(3) ~ 0.94
    assert set(draw(peaked, SamplingParams(top_p=0.9, seed=2), steps=100)) == {3}
    assert len(set(draw(peaked, SamplingParams(top_p=1.0, seed=2), steps=400))) > 1


def test_logprobs_are_of_the_chosen_tokens() -> None:
    out = sample(LOGITS.clone(), seqs(SamplingParams(temperature=0.0, logprobs=True)))
    assert out.logprobs == pytest.approx([float(LOGITS.log_softmax(-1)[0, out.tokens[0]])])


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_model().tokenizer


def stream(tokenizer: PreTrainedTokenizerBase, text: str, stop: list[str]) -> tuple[list[str], bool]:
    prompt = tokenizer.encode("Say:")
    ids = list(prompt)
    detok = IncrementalDetokenizer(tokenizer, ids, stop)
    deltas = []
    for token in tokenizer.encode(text):
        ids.append(token)
        if detok.update():
            deltas.append(detok.delta(True))
            return deltas, True
        deltas.append(detok.delta(False))
    deltas.append(detok.delta(True))
    return deltas, False


def test_text_deltas_never_split_a_character(tokenizer: PreTrainedTokenizerBase) -> None:
    text = " naïve café 日本語 🎉🚀 done"
    deltas, stopped = stream(tokenizer, text, [])
    assert not stopped and "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_never_streamed(tokenizer: PreTrainedTokenizerBase) -> None:
    deltas, stopped = stream(tokenizer, " one two three four five", ["three f"])
    assert stopped and "".join(deltas) == " one two "
    assert all("three" not in d for d in deltas)
