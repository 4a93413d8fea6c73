"""The batched sampler's per-row parameters against transformers' logits processors and the
OpenAI definitions: penalties, min-p, logit bias, top-k / top-p, and seeds across batch neighbours."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.worker.engine.penalties import apply_logit_bias, apply_penalties
from services.worker.engine.sampler import _restrict, sample
from services.worker.engine.sequence import EngineRequest, Sequence
from shared.schemas import SamplingParams

VOCAB = 64
GEN = torch.Generator().manual_seed(7)


def seq_with(params: SamplingParams, prompt: list[int], output: list[int], rid: str = "r") -> Sequence:
    seq = Sequence(EngineRequest(rid, prompt, params), tokenizer=None)
    seq.token_ids.extend(output)
    return seq


def history(n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=GEN).tolist()


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_over_prompt_and_output(penalty: float) -> None:
    prompt, output = history(12), history(7)
    logits = torch.randn(1, VOCAB, generator=GEN) * 4
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    got = logits.clone()
    apply_penalties(got, [seq_with(SamplingParams(repetition_penalty=penalty), prompt, output)])
    torch.testing.assert_close(got, expected)


def test_presence_and_frequency_follow_openais_definition_over_the_output_only() -> None:
    prompt, output = [1, 2, 3], [5, 5, 5, 9, 2]
    logits = torch.randn(1, VOCAB, generator=GEN)
    got = logits.clone()
    apply_penalties(got, [seq_with(SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), prompt, output)])
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    torch.testing.assert_close(got[0], logits[0] - 0.4 * counts - 0.7 * (counts > 0).float())
    assert got[0, 1] == logits[0, 1] and got[0, 3] == logits[0, 3]  # prompt tokens are not penalised


def test_each_row_gets_only_its_own_penalty() -> None:
    prompt = history(10)
    rows = [
        seq_with(SamplingParams(), prompt, history(5), "a"),
        seq_with(SamplingParams(repetition_penalty=1.5), prompt, history(5), "b"),
        seq_with(SamplingParams(frequency_penalty=1.0), prompt, history(5), "c"),
    ]
    logits = torch.randn(3, VOCAB, generator=GEN)
    got = logits.clone()
    apply_penalties(got, rows)
    for row, seq in enumerate(rows):
        alone = logits[row : row + 1].clone()
        apply_penalties(alone, [seq])
        torch.testing.assert_close(got[row : row + 1], alone)
    assert torch.equal(got[0], logits[0])


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    logits = torch.randn(2, VOCAB, generator=GEN)
    processor = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = processor(torch.tensor([[1]]), logits[1:].clone())
    got = logits.clone()
    apply_logit_bias(got, [seq_with(SamplingParams(), [1], []), seq_with(SamplingParams(logit_bias=bias), [1], [])])
    torch.testing.assert_close(got[1:], expected)
    assert torch.equal(got[0], logits[0])


def reference_warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers in vLLM's order: temperature, min-p, top-k, top-p."""
    ids = torch.tensor([[0]])
    out = TemperatureLogitsWarper(params.temperature)(ids, logits.clone())
    if params.min_p:
        out = MinPLogitsWarper(params.min_p)(ids, out)
    if params.top_k:
        out = TopKLogitsWarper(params.top_k)(ids, out)
    if params.top_p < 1.0:
        out = TopPLogitsWarper(params.top_p)(ids, out)
    return out


def test_min_p_top_k_top_p_keep_the_same_support_as_transformers_per_row() -> None:
    rows = [
        SamplingParams(temperature=0.7, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=9),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.02, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.randn(len(rows), VOCAB, generator=GEN) * 3
    seqs = [seq_with(p, [1], [], str(i)) for i, p in enumerate(rows)]
    temps = torch.tensor([[p.temperature] for p in rows])
    got = _restrict(logits / temps, seqs)
    for row, params in enumerate(rows):
        expected = reference_warp(logits[row : row + 1], params)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(expected[0])), params
        kept = ~torch.isinf(expected[0])
        torch.testing.assert_close(got[row][kept], expected[0][kept])


def test_min_p_sampling_never_draws_below_the_threshold() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01] + [1e-6] * (VOCAB - 5)]))
    params = SamplingParams(temperature=1.0, min_p=0.1, seed=3)  # keeps p >= 0.05
    seq = seq_with(params, [1], [])
    drawn = {sample(logits.clone(), [seq]).tokens[0] for _ in range(300)}
    assert drawn == {0, 1, 2}


def draws(seq: Sequence, neighbours: list[Sequence], logits: torch.Tensor, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        batch = [*neighbours, seq]
        noise = torch.randn(len(neighbours), VOCAB)
        out.append(sample(torch.cat([noise, logits]), batch).tokens[-1])
    return out


def test_a_seed_draws_the_same_tokens_whatever_its_batch_neighbours() -> None:
    logits = torch.randn(1, VOCAB, generator=GEN)
    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, seed=42)
    alone = draws(seq_with(params, [1], [], "x"), [], logits, 30)
    crowd = [
        seq_with(SamplingParams(temperature=0.8, seed=1), [1], [], "n1"),
        seq_with(SamplingParams(temperature=1.2), [1], [], "n2"),
        seq_with(SamplingParams(temperature=0.0), [1], [], "n3"),
    ]
    assert draws(seq_with(params, [1], [], "x"), crowd, logits, 30) == alone
    assert draws(seq_with(params, [1], [], "x"), crowd[1:], logits, 30) == alone
    assert len(set(alone)) > 1
    other = draws(seq_with(params.model_copy(update={"seed": 43}), [1], [], "x"), crowd, logits, 30)
    assert other != alone


def test_greedy_rows_see_bias_and_penalties() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 2.0
    banned = seq_with(SamplingParams(temperature=0.0, logit_bias={5: -100.0}), [1], [], "a")
    repeated = seq_with(SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0), [1], [5], "b")
    logits[:, 6] = 1.0
    assert sample(logits, [banned, repeated]).tokens == [6, 6]
