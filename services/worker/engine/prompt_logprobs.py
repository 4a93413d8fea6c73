"""Prompt logprobs: each prompt token's logprob under the model given the tokens before it.

Of the raw model (fp32 log-softmax of the logits, before any sampling transform), as the output
tokens' logprobs are. The first token has nothing before it: its entry's logprob is None."""

from collections.abc import Callable

import torch

from services.worker.engine.token_text import TokenText
from shared.schemas import TokenLogprob

ROWS_PER_CHUNK = 256  # logits are computed this many positions at a time: [256, vocab] fp32 at most


def prompt_entries(
    prompt_ids: list[int],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    k: int,
    token_text: TokenText,
) -> list[TokenLogprob]:
    """prompt_ids: [n]; hidden: [n - 1, hidden] the last layer's output at positions 0 .. n - 2;
    ``logits_of`` maps hidden rows to fp32 logits -> n entries, each with its ``k`` most likely alternatives."""
    targets = torch.tensor(prompt_ids[1:], dtype=torch.int64, device=hidden.device)
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    with torch.inference_mode():
        for lo in range(0, targets.shape[0], ROWS_PER_CHUNK):
            scores = logits_of(hidden[lo : lo + ROWS_PER_CHUNK]).log_softmax(-1)
            chosen += scores.gather(1, targets[lo : lo + ROWS_PER_CHUNK].unsqueeze(1)).squeeze(1).tolist()
            if k:
                top = scores.topk(k, -1)
                top_ids += top.indices.tolist()
                top_lps += top.values.tolist()
    first_text, first_bytes = token_text.of(prompt_ids[0])
    entries = [TokenLogprob(token=first_text, logprob=None, bytes=first_bytes)]
    for i, token in enumerate(prompt_ids[1:]):
        entries.append(token_text.entry(token, chosen[i], top_ids[i] if k else [], top_lps[i] if k else []))
    return entries
