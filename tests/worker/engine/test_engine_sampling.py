"""The engine's OpenAI sampling surface on SmolLM2 (fp32) against transformers: logprobs and top
logprobs, penalties and logit bias on crafted prompts, stop token ids, seeds across neighbours."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.convert_slow_tokenizer import bytes_to_unicode

from services.worker.engine import EngineRequest, LLMEngine, UnsupportedSampling
from services.worker.engine.model_loader import LoadedModel, load_model
from shared.schemas import SamplingParams
from tests.worker.engine.test_engine import make_engine, run

BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
REPEAT = "Repeat this line exactly, ten times: the cat sat on the mat."
NEW = 32
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> LLMEngine:
    return make_engine(loaded)


def chat(loaded: LoadedModel, text: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def generate_one(engine: LLMEngine, ids: list[int], params: SamplingParams, rid: str = "r") -> tuple[list[int], str]:
    engine.add_request(EngineRequest(rid, ids, params))
    tokens, text, _ = run(engine)[rid]
    return tokens, text


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence / frequency definition over the generated tokens only."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


def hf_greedy(loaded: LoadedModel, ids: list[int], **kwargs: object) -> list[int]:
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


def most_repeated(tokens: list[int]) -> int:
    return max(tokens.count(t) for t in set(tokens))


def test_repetition_penalty_equals_transformers_and_repeats_less(loaded: LoadedModel, engine: LLMEngine) -> None:
    ids = chat(loaded, REPEAT)
    plain, _ = generate_one(engine, ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    penalised, _ = generate_one(
        engine, ids, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, repetition_penalty=1.5)
    )
    assert penalised == hf_greedy(loaded, ids, repetition_penalty=1.5, min_new_tokens=NEW)
    assert most_repeated(penalised) < most_repeated(plain)


@pytest.mark.parametrize(("presence", "frequency"), [(1.5, 0.0), (0.0, 1.0), (-1.0, 0.0)])
def test_presence_and_frequency_penalties_follow_their_definition(
    loaded: LoadedModel, engine: LLMEngine, presence: float, frequency: float
) -> None:
    ids = chat(loaded, REPEAT)
    no_eos = {EOS: -100.0}  # both sides run the whole length (min_new_tokens would differ: it sets -inf)
    params = SamplingParams(
        max_tokens=NEW, temperature=0.0, logit_bias=no_eos, presence_penalty=presence, frequency_penalty=frequency
    )
    tokens, _ = generate_one(engine, ids, params)
    processors = LogitsProcessorList([OpenAIPenalties(len(ids), presence, frequency)])
    assert tokens == hf_greedy(loaded, ids, logits_processor=processors, sequence_bias={(EOS,): -100.0})
    plain, _ = generate_one(engine, ids, SamplingParams(max_tokens=NEW, temperature=0.0, logit_bias=no_eos))
    if presence + frequency > 0:
        assert len(set(tokens)) > len(set(plain))  # penalising what appeared brings in new tokens
    else:
        assert len(set(tokens)) <= len(set(plain))  # a reward for what appeared keeps to it


def test_logit_bias_equals_transformers_sequence_bias(loaded: LoadedModel, engine: LLMEngine) -> None:
    ids = chat(loaded, "What is the capital of France?")
    plain, _ = generate_one(engine, ids, SamplingParams(max_tokens=NEW, temperature=0.0))
    bias = {plain[0]: -100.0, plain[2]: 3.0}
    tokens, _ = generate_one(engine, ids, SamplingParams(max_tokens=NEW, temperature=0.0, logit_bias=bias))
    assert tokens[0] != plain[0] and plain[0] not in tokens
    expected = hf_greedy(loaded, ids, sequence_bias={(t,): b for t, b in bias.items()})
    assert tokens == expected[: len(tokens)]


def test_stop_token_ids_end_the_output_without_their_text(loaded: LoadedModel, engine: LLMEngine) -> None:
    ids = chat(loaded, "What is the capital of France?")
    plain, _ = generate_one(engine, ids, SamplingParams(max_tokens=NEW, temperature=0.0))
    stop = plain[4]
    engine.add_request(EngineRequest("s", ids, SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=[stop])))
    tokens, text, reason = run(engine)["s"]
    first = plain.index(stop)
    assert tokens == plain[: first + 1] and reason == "stop"
    assert text == loaded.tokenizer.decode(plain[:first], skip_special_tokens=True)


def test_token_ids_outside_the_vocabulary_are_refused(loaded: LoadedModel, engine: LLMEngine) -> None:
    vocab = engine.vocab_size
    for params in (SamplingParams(logit_bias={vocab: 1.0}), SamplingParams(stop_token_ids=[vocab + 5])):
        with pytest.raises(UnsupportedSampling):
            engine.add_request(EngineRequest("bad", [1, 2], params))


def test_logprobs_and_top_logprobs_equal_transformers_within_1e_4(loaded: LoadedModel, engine: LLMEngine) -> None:
    ids = chat(loaded, "Name three colours.")
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=True, top_logprobs=20)
    engine.add_request(EngineRequest("lp", ids, params))
    entries, tokens = [], []
    while engine.has_unfinished():
        for out in engine.step():
            assert out.token_logprobs is not None and len(out.token_logprobs) == len(out.token_ids)
            entries += out.token_logprobs
            tokens += out.token_ids
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    reference = logits.log_softmax(-1)
    for position, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        assert entry.logprob == pytest.approx(float(reference[position, token]), abs=1e-4)
        assert entry.token == loaded.tokenizer.decode([token]) and bytes(entry.bytes) == entry.token.encode()
        top = reference[position].topk(20)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [text_of(loaded, i) for i in top.indices.tolist()]
        assert all(
            bytes(t.bytes).decode(errors="replace") == loaded.tokenizer.decode(i)
            for t, i in zip(entry.top_logprobs, top.indices.tolist(), strict=True)
        )


def text_of(loaded: LoadedModel, token: int) -> str:
    """OpenAI's spelling: the text, or ``bytes:\\xNN..`` for a token that is part of a character."""
    text = loaded.tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    piece = loaded.tokenizer.convert_ids_to_tokens(token)
    return "bytes:" + "".join(f"\\x{b:02x}" for b in bytes(BYTE_DECODER[c] for c in piece))


def test_a_seeded_request_samples_the_same_whatever_runs_beside_it(loaded: LoadedModel, engine: LLMEngine) -> None:
    ids = chat(loaded, "Tell me a story about a fox.")
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234)
    alone, _ = generate_one(engine, ids, params, "alone")
    engine.add_request(EngineRequest("n1", chat(loaded, "Count to ten."), SamplingParams(max_tokens=8, seed=1)))
    engine.add_request(EngineRequest("n2", chat(loaded, "Hello"), SamplingParams(max_tokens=30, temperature=1.3)))
    engine.add_request(EngineRequest("seeded", ids, params))
    assert run(engine)["seeded"][0] == alone
    other, _ = generate_one(engine, ids, params.model_copy(update={"seed": 4321}), "other")
    assert other != alone
