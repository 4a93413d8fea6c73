"""A long prompt's logprobs leave the worker in pieces that each fit the bus's payload limit."""

from services.worker.serving import PROMPT_PIECE_BYTES, prompt_pieces
from shared.bus import encode
from shared.memory_bus import DEFAULT_MAX_PAYLOAD
from shared.schemas import ReplyEnvelope, TokenLogprob, TopLogprob


def entry(i: int, k: int) -> TokenLogprob:
    alternatives = [
        TopLogprob(token=f"alternative-{j}", logprob=-1.5 - j, bytes=list(b"alternative")) for j in range(k)
    ]
    return TokenLogprob(
        token=f" word{i}", logprob=None if i == 0 else -0.125 * i, bytes=list(b" word"), top_logprobs=alternatives
    )


def test_pieces_cover_the_prompt_in_order_and_each_fits_the_payload_limit() -> None:
    entries = [entry(i, 20) for i in range(1000)]  # a long prompt with 20 alternatives per token: megabytes
    pieces = prompt_pieces("r1", entries)
    assert len(pieces) > 1
    assert [p.start for p in pieces] == [sum(len(q.entries) for q in pieces[:i]) for i in range(len(pieces))]
    assert [e for p in pieces for e in p.entries] == entries
    assert all(p.total == len(entries) for p in pieces)
    sizes = [len(encode(ReplyEnvelope(body=p))) for p in pieces]
    assert max(sizes) < DEFAULT_MAX_PAYLOAD and max(sizes) <= PROMPT_PIECE_BYTES + 4096
    assert sum(sizes) > DEFAULT_MAX_PAYLOAD  # as one message it would not fit


def test_a_short_prompt_is_one_piece_and_no_prompt_is_none() -> None:
    entries = [entry(i, 0) for i in range(3)]
    assert [(p.start, len(p.entries)) for p in prompt_pieces("r1", entries)] == [(0, 3)]
    assert prompt_pieces("r1", []) == []
