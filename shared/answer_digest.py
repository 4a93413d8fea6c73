"""An answer as the platform compares it without keeping its text: digests of its output token ids.

A shadow run (the canary answering a production request's prompt) and the production run each carry
one; the registry pairs them by request and measures agreement from the digests alone, so neither
answer's text reaches an audit record."""

import hashlib

from shared.schemas import AnswerDigest

PREFIX_HEX = 16  # 64 bits per prefix digest: a collision between two answers is not a concern


def _digest(token_ids: list[int], hex_chars: int | None = None) -> str:
    raw = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in token_ids)).hexdigest()
    return raw if hex_chars is None else raw[:hex_chars]


def checkpoints(n: int) -> list[int]:
    """Prefix lengths digested of an answer of ``n`` tokens: 1, 2, 4, ... below ``n``, then ``n``."""
    lengths, k = [], 1
    while k < n:
        lengths.append(k)
        k *= 2
    return [*lengths, n] if n else []


def digest_answer(token_ids: list[int]) -> AnswerDigest:
    """The answer's token count, the digest of all its tokens, and of its prefixes at ``checkpoints``."""
    return AnswerDigest(
        tokens=len(token_ids),
        digest=_digest(token_ids),
        prefixes=[_digest(token_ids[:k], PREFIX_HEX) for k in checkpoints(len(token_ids))],
    )


def agreement(a: AnswerDigest, b: AnswerDigest) -> tuple[bool, float]:
    """(the answers are the same tokens, the share of the longer answer the two agree on from the
    start). The shared prefix is known at the checkpoints only (powers of two), so the share is a
    lower bound: within a factor of two of the true common prefix."""
    if a.tokens == b.tokens and a.digest == b.digest:
        return True, 1.0
    longest = max(a.tokens, b.tokens)
    mine = dict(zip(checkpoints(a.tokens), a.prefixes, strict=False))
    theirs = dict(zip(checkpoints(b.tokens), b.prefixes, strict=False))
    common = 0
    for k in sorted(mine.keys() & theirs.keys()):
        if mine[k] != theirs[k]:
            break
        common = k
    return False, common / longest if longest else 1.0
