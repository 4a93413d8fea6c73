"""The echoed prompt's logprobs in the completions shape: offsets index the echoed text."""

from services.gateway.openai_format import echo_logprobs
from shared.schemas import TokenLogprob, TopLogprob


def entry(token: str, logprob: float | None) -> TokenLogprob:
    top = [] if logprob is None else [TopLogprob(token="x", logprob=-9.0, bytes=[120])]
    return TokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()), top_logprobs=top)


def test_offsets_count_from_0_and_the_first_token_has_nothing_predicting_it() -> None:
    shaped = echo_logprobs([entry("Hello", None), entry(" wor", -1.0), entry("ld", -0.5)], "Hello world")
    assert shaped == {
        "tokens": ["Hello", " wor", "ld"],
        "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {" wor": -1.0, "x": -9.0}, {"ld": -0.5, "x": -9.0}],
        "text_offset": [0, 5, 9],
    }


def test_a_bos_the_tokenizer_added_takes_no_width() -> None:
    prompt = "Hello world"
    shaped = echo_logprobs([entry("<s>", None), entry("Hello", -2.0), entry(" world", -1.0)], prompt)
    assert shaped["tokens"] == ["<s>", "Hello", " world"] and shaped["token_logprobs"] == [None, -2.0, -1.0]
    assert shaped["text_offset"] == [0, 0, 5]
    assert [prompt[o:].startswith(t) for o, t in zip(shaped["text_offset"][1:], shaped["tokens"][1:], strict=True)] == [
        True,
        True,
    ]
