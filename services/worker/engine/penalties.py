"""Logit bias and repetition / presence / frequency penalties, applied per row in one batched pass."""

import torch

from services.worker.engine.sequence import Sequence


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """logits: [num_seqs, vocab] fp32, in place: ``logits[row, token] += bias`` for each request's bias."""
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row, seq in enumerate(seqs):
        for token, bias in seq.request.sampling.logit_bias.items():
            rows.append(row)
            tokens.append(token)
            values.append(bias)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
        logits.index_put_(index, torch.tensor(values, device=logits.device), accumulate=True)


def _penalised(seq: Sequence) -> bool:
    p = seq.request.sampling
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _padded(id_lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, longest] int64 ids (padding 0) and [rows, longest] fp32 1/0 weights of the real ones."""
    longest = max((len(ids) for ids in id_lists), default=0) or 1
    ids = torch.zeros(len(id_lists), longest, dtype=torch.int64)
    weight = torch.zeros(len(id_lists), longest)
    for i, row in enumerate(id_lists):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        weight[i, : len(row)] = 1.0
    return ids.to(device), weight.to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """logits: [num_seqs, vocab] fp32, in place, on the rows whose request asks for a penalty.

    repetition (as transformers' RepetitionPenaltyLogitsProcessor, over prompt and output):
    ``l = where(seen, where(l > 0, l / r, l * r), l)``; then, over the output only (OpenAI's
    definition): ``l -= frequency * count + presence * (count > 0)``.
    """
    rows = [row for row, seq in enumerate(seqs) if _penalised(seq)]
    if not rows:
        return
    device = logits.device
    sub = logits[rows]
    vocab = sub.shape[1]
    params = [seqs[row].request.sampling for row in rows]
    outputs = [seqs[row].token_ids[seqs[row].num_prompt_tokens :] for row in rows]
    out_ids, out_weight = _padded(outputs, device)
    counts = torch.zeros(len(rows), vocab, device=device).scatter_add_(1, out_ids, out_weight)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_ids, prompt_weight = _padded([seqs[row].request.prompt_token_ids for row in rows], device)
        seen = counts > 0
        seen |= torch.zeros(len(rows), vocab, device=device).scatter_add_(1, prompt_ids, prompt_weight) > 0
        penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalised, sub)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    logits[rows] = sub
