"""Logit bias and repetition / presence / frequency penalties, applied per row in one batched pass."""

import torch

from services.worker.engine.sequence import Sequence
from services.worker.engine.upload import to_device, upload


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
        index = (to_device(rows, logits.device), to_device(tokens, logits.device))
        logits.index_put_(index, to_device(values, logits.device), accumulate=True)


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
    return upload(ids, device), upload(weight, device)


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
    index = to_device(rows, device)
    sub = logits[index]
    vocab = sub.shape[1]
    params = [seqs[row].request.sampling for row in rows]
    outputs = [seqs[row].token_ids[seqs[row].num_prompt_tokens :] for row in rows]
    out_ids, out_weight = _padded(outputs, device)
    counts = torch.zeros(len(rows), vocab, device=device).scatter_add_(1, out_ids, out_weight)
    repetition = to_device([p.repetition_penalty for p in params], device).unsqueeze(1)
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_ids, prompt_weight = _padded([seqs[row].request.prompt_token_ids for row in rows], device)
        seen = counts > 0
        seen |= torch.zeros(len(rows), vocab, device=device).scatter_add_(1, prompt_ids, prompt_weight) > 0
        penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalised, sub)
    frequency = to_device([p.frequency_penalty for p in params], device).unsqueeze(1)
    presence = to_device([p.presence_penalty for p in params], device).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    logits[index] = sub
