"""Next-token choice per sequence: greedy, or temperature / top-k / top-p with a per-request seed."""

import torch

from services.worker.engine.sequence import Sequence


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [vocab] fp32 -> logits with tokens outside top-k and the top-p nucleus set to -inf."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keeps the token that crosses top_p
        logits = logits.index_put((order[drop],), torch.tensor(float("-inf")))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], want_logprobs: bool) -> tuple[list[int], list[float] | None]:
    """logits: [num_seqs, vocab] fp32, one row per sequence -> token per sequence and its logprob.

    Sampled rows draw from the sequence's own seeded generator, so a seeded request yields the
    same tokens whatever it is batched with.
    """
    tokens = logits.argmax(-1).tolist()
    for row, seq in enumerate(seqs):
        params = seq.request.sampling
        if params.temperature == 0.0 or params.top_k == 1:
            continue
        # On CPU, where the sequence's seeded generator lives.
        filtered = _filter(logits[row].cpu() / params.temperature, params.top_k, params.top_p)
        probs = filtered.softmax(-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator))
    if not want_logprobs:
        return tokens, None
    chosen = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    logprobs = logits.log_softmax(-1).gather(1, chosen).squeeze(1)
    return tokens, logprobs.tolist()
