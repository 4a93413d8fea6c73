"""Per-step LoRA metadata: tokens sorted by (rank class, slot) and cut into segments, in place.

Built on the host from the step's token slots (one device -> host read per step, not per
projection), then copied into device buffers allocated once at max size.
"""

from dataclasses import dataclass

import torch

from kernels import LoraIndex, find_segments
from kernels.reference import INDEX_DTYPE, Segment


@dataclass(slots=True)
class LoraMetadata:
    """Index buffers of every rank class; each step refills a prefix of them."""

    host_idx: torch.Tensor  # [max_tokens] int32, tokens sorted by global slot (host, pinned on CUDA)
    host_row: torch.Tensor  # [max_tokens] int32, row of each sorted token in its class's stack (host)
    host_seg_start: torch.Tensor  # [num_classes, max_tokens + 1] int32, per class offsets into its tokens (host)
    host_seg_row: torch.Tensor  # [num_classes, max_tokens] int32, per class stack row of each segment (host)
    token_idx: torch.Tensor  # [max_tokens] int32, device copy of host_idx
    token_row: torch.Tensor  # [max_tokens] int32, device copy of host_row
    seg_start: torch.Tensor  # [num_classes, max_tokens + 1] int32, device copy of host_seg_start
    seg_row: torch.Tensor  # [num_classes, max_tokens] int32, device copy of host_seg_row

    @classmethod
    def allocate(cls, max_tokens: int, num_classes: int, device: torch.device | str) -> "LoraMetadata":
        device = torch.device(device)
        pin = device.type == "cuda"

        def host(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=INDEX_DTYPE, pin_memory=pin)

        host_bufs = (host(max_tokens), host(max_tokens), host(num_classes, max_tokens + 1), host(num_classes, max_tokens))
        dev_bufs = host_bufs if not pin else tuple(torch.zeros_like(t, device=device) for t in host_bufs)
        return cls(*host_bufs, *dev_bufs)

    @property
    def max_tokens(self) -> int:
        return self.host_idx.shape[0]

    def fill(self, token_slots: torch.Tensor, class_first_slots: list[int]) -> list[LoraIndex]:
        """Refill the buffers for a step; one index per rank class (empty when no token uses it).

        token_slots: [num_tokens] global slot per token, -1 = base; class_first_slots: the first
        global slot of each rank class, ascending, plus one past the last slot at the end.
        """
        n = token_slots.shape[0]
        if n > self.max_tokens:
            raise ValueError(f"{n} tokens exceed the {self.max_tokens} the LoRA metadata was sized for")
        slots = token_slots.to("cpu", torch.int64)
        sorted_slots, order = torch.sort(slots, stable=True)
        if n and (sorted_slots[0] < -1 or sorted_slots[-1] >= class_first_slots[-1]):
            raise ValueError(f"token slots must lie in [-1, {class_first_slots[-1]}), got {slots.unique().tolist()}")
        bounds = torch.searchsorted(sorted_slots, torch.tensor(class_first_slots)).tolist()
        begin, end = bounds[0], bounds[-1]
        self.host_idx[begin:end].copy_(order[begin:end])
        self.host_row[begin:end].copy_(sorted_slots[begin:end])
        indexes: list[tuple[int, int, tuple[Segment, ...]]] = []
        for c, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            self.host_row[lo:hi].sub_(class_first_slots[c])
            segments = find_segments(self.host_idx[lo:hi], self.host_row[lo:hi])
            num_segments = len(segments)
            self.host_seg_start[c, :num_segments].copy_(torch.tensor([s[0] for s in segments], dtype=INDEX_DTYPE))
            self.host_seg_start[c, num_segments] = hi - lo
            self.host_seg_row[c, :num_segments].copy_(torch.tensor([s[2] for s in segments], dtype=INDEX_DTYPE))
            indexes.append((lo, hi, segments))
        if self.token_idx is not self.host_idx:
            # Blocking: the next step rewrites these host buffers, which must not race this copy.
            for dst, src in zip(self._device_buffers(), self._host_buffers()):
                dst.copy_(src)
        return [
            LoraIndex(
                token_idx=self.token_idx[lo:hi],
                token_row=self.token_row[lo:hi],
                seg_start=self.seg_start[c, : len(segments) + 1],
                seg_row=self.seg_row[c, : len(segments)],
                max_seg_len=max((e - s for s, e, _, _ in segments), default=0),
                segments=segments,
            )
            for c, (lo, hi, segments) in enumerate(indexes)
        ]

    def _host_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.host_idx, self.host_row, self.host_seg_start, self.host_seg_row

    def _device_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.token_idx, self.token_row, self.seg_start, self.seg_row
