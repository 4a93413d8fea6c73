"""Flatten one scheduled step into the tensors the forward pass reads.

The step's integers are laid out once on the host, in one tensor (pinned on CUDA), and reach the
device in one non-blocking copy; every per-token and per-sequence field is a view of that copy, and
the decode mask is computed on the device from the sequences' lengths.
"""

from dataclasses import dataclass

import torch

from services.worker.engine.attention import AttentionMetadata
from services.worker.engine.sequence import Sequence
from services.worker.engine.upload import to_device, upload


@dataclass(slots=True)
class StepBatch:
    seqs: list[Sequence]  # decodes first, then prefills: the order of tokens and logits
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    token_slots: torch.Tensor  # [num_tokens] int64 on the host, adapter slot of each token, -1 = base model
    logits_indices: torch.Tensor  # [num_seqs] int64 last token of each sequence
    meta: AttentionMetadata
    has_adapters: bool = False  # some token has an adapter slot (known on the host, no device read)


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
    blocks: list[int] = []
    for seq in decodes:
        blocks += seq.block_table
        blocks += [0] * (max_blocks - len(seq.block_table))
    lengths = [seq.num_tokens for seq in decodes]
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
    t, d = len(ids), len(decodes)
    host = torch.tensor(ids + positions + slots + last + lengths + blocks + adapters, dtype=torch.int64)
    fields = upload(host[: host.shape[0] - t], device)  # the adapter slots stay on the host, for the LoRA metadata
    s = len(last)
    input_ids, position_ids, slot_mapping, logits_indices, lens, decode_blocks = torch.split(
        fields, [t, t, t, s, d, d * max_blocks]
    )
    width = max_blocks * block_size
    mask = torch.arange(width, device=fields.device).unsqueeze(0) < lens.unsqueeze(1)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decode=d,
        decode_blocks=decode_blocks,
        decode_mask=mask.view(1, d, 1, width),
        decode_lengths=lens,
        prefill_bounds=bounds,
        prefill_contexts=contexts,
    )
    return StepBatch(
        seqs=decodes + prefills,
        input_ids=input_ids,
        positions=position_ids,
        token_slots=host[host.shape[0] - t :],
        logits_indices=logits_indices,
        meta=meta,
        has_adapters=any(slot >= 0 for slot in adapters),
    )


def _prefix_context(slots: list[int], cached: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of a prefill's whole context and its causal bias: new token i (position
    ``cached + i``) sees the shared prefix and the new tokens up to itself."""
    n = len(slots)
    rows = torch.arange(cached, n).unsqueeze(1)
    bias = torch.zeros(n - cached, n).masked_fill_(torch.arange(n).unsqueeze(0) > rows, float("-inf"))
    return to_device(slots, device), upload(bias, device)
