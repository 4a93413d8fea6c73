"""Flatten one scheduled step into the tensors the forward pass reads."""

from dataclasses import dataclass

import torch

from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.sequence import Sequence


@dataclass(slots=True)
class StepBatch:
    seqs: list[Sequence]  # decodes first, then prefills: the order of tokens and logits
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    token_slots: torch.Tensor  # [num_tokens] int64 adapter slot of each token, -1 = base model
    logits_indices: torch.Tensor  # [num_seqs] int64 last token of each sequence
    meta: AttentionMetadata


def build_batch(decodes: list[Sequence], prefills: list[Sequence], block_size: int, device: str) -> StepBatch:
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    adapters: list[int] = []
    for seq in decodes:
        pos = seq.num_tokens - 1
        ids.append(seq.token_ids[-1])
        positions.append(pos)
        slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
        adapters.append(seq.slot)
    max_blocks = max((len(seq.block_table) for seq in decodes), default=0)
    tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in decodes]
    lengths = torch.tensor([seq.num_tokens for seq in decodes], dtype=torch.int64)
    mask = torch.arange(max_blocks * block_size).unsqueeze(0) < lengths.unsqueeze(1)
    bounds = []
    contexts: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for seq in prefills:
        start = len(ids)
        cached, n = seq.num_cached, seq.num_tokens
        table = seq.block_table
        ids.extend(seq.token_ids[cached:])
        positions.extend(range(cached, n))
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
        slots.extend(seq_slots[cached:])
        adapters.extend([seq.slot] * (n - cached))
        bounds.append((start, start + n - cached))
        contexts.append(None if cached == 0 else _prefix_context(seq_slots, cached, device))
    last = list(range(len(decodes))) + [end - 1 for _, end in bounds]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots),
        num_decode=len(decodes),
        decode_blocks=tensor([b for row in tables for b in row]),
        decode_mask=mask.view(1, len(decodes), 1, max_blocks * block_size).to(device),
        prefill_bounds=bounds,
        prefill_contexts=contexts,
    )
    return StepBatch(
        seqs=decodes + prefills,
        input_ids=tensor(ids),
        positions=tensor(positions),
        token_slots=tensor(adapters),
        logits_indices=tensor(last),
        meta=meta,
    )


def _prefix_context(slots: list[int], cached: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of a prefill's whole context and its causal bias: new token i (position
    ``cached + i``) sees the shared prefix and the new tokens up to itself."""
    n = len(slots)
    rows = torch.arange(cached, n).unsqueeze(1)
    bias = torch.zeros(n - cached, n).masked_fill_(torch.arange(n).unsqueeze(0) > rows, float("-inf"))
    return torch.tensor(slots, dtype=torch.int64, device=device), bias.to(device)
