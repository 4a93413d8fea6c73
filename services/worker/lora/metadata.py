"""Per-step LoRA metadata: tokens sorted by (rank class, slot) and cut into segments, in place.

Built on the host from the step's token slots (which the engine keeps on the host: no device read),
then copied into device buffers allocated once at max size, non-blocking from pinned memory. Global slot ids
ascend with the rank class, so one sort groups tokens by class and, within it, by slot.
"""

from bisect import bisect_left
from dataclasses import dataclass

import torch

from kernels import LoraIndex, find_segments
from kernels.reference import INDEX_DTYPE, Segment


@dataclass(slots=True)
class LoraMetadata:
    """Index buffers of every rank class; each step refills a prefix of them.

    Class c's tokens are token_idx[lo_c:hi_c]; its segments are seg_row[g_c:g_c + G_c] with
    offsets seg_start[g_c + c : g_c + c + G_c + 1] relative to lo_c.
    """

    host_idx: torch.Tensor  # [max_tokens] int32, adapter tokens sorted by global slot (host, pinned on CUDA)
    host_row: torch.Tensor  # [max_tokens] int32, each sorted token's row in its class's stack (host)
    host_seg_start: torch.Tensor  # [max_tokens + num_classes] int32, per class segment offsets (host)
    host_seg_row: torch.Tensor  # [max_tokens] int32, stack row of each segment (host)
    token_idx: torch.Tensor  # [max_tokens] int32, device copy of host_idx
    token_row: torch.Tensor  # [max_tokens] int32, device copy of host_row
    seg_start: torch.Tensor  # [max_tokens + num_classes] int32, device copy of host_seg_start
    seg_row: torch.Tensor  # [max_tokens] int32, device copy of host_seg_row
    class_first_slots: list[int]  # [num_classes + 1] first global slot of each class, then the slot count
    num_tokens: int = 0  # adapter tokens of the last fill
    num_segments: int = 0  # segments of the last fill, all classes
    copied: torch.cuda.Event | None = None  # recorded after the last fill's host -> device copies (CUDA)

    @classmethod
    def allocate(cls, max_tokens: int, class_first_slots: list[int], device: torch.device | str) -> "LoraMetadata":
        """Buffers for steps of up to max_tokens; class_first_slots: each class's first slot, then the slot count."""
        device = torch.device(device)
        pin = device.type == "cuda"
        num_classes = len(class_first_slots) - 1
        sizes = (max_tokens, max_tokens, max_tokens + num_classes, max_tokens)
        host = [torch.zeros(size, dtype=INDEX_DTYPE, pin_memory=pin) for size in sizes]
        dev = host if not pin else [torch.zeros_like(t, device=device) for t in host]
        host_idx, host_row, host_seg_start, host_seg_row = host
        token_idx, token_row, seg_start, seg_row = dev
        return cls(
            host_idx=host_idx,
            host_row=host_row,
            host_seg_start=host_seg_start,
            host_seg_row=host_seg_row,
            token_idx=token_idx,
            token_row=token_row,
            seg_start=seg_start,
            seg_row=seg_row,
            class_first_slots=list(class_first_slots),
        )

    def fill(self, token_slots: torch.Tensor) -> list[LoraIndex | None]:
        """Refill the buffers for a step's token_slots ([num_tokens], -1 = base): one index per rank
        class, None for a class no token uses.

        Sorted and cut on host lists: 8 decode tokens of 8 adapters take ~60 us (most of it the four
        small copies into the buffers) against ~165 us for the dozen small tensor ops this replaced; a
        prefill's 800 tokens ~310 us against ~175, a fraction of a percent of that step.
        """
        if token_slots.shape[0] > self.host_idx.shape[0]:
            raise ValueError(f"{token_slots.shape[0]} tokens exceed the {self.host_idx.shape[0]} the metadata holds")
        if self.copied is not None:
            # The last fill's copies must have read the host buffers before they are rewritten: done
            # at once in the engine, whose every step ends by reading its results from the device.
            self.copied.synchronize()
        slots: list[int] = token_slots.tolist()
        first_slots = self.class_first_slots
        order = sorted((t for t, slot in enumerate(slots) if slot != -1), key=slots.__getitem__)  # stable
        sorted_slots = [slots[t] for t in order]
        if sorted_slots and (sorted_slots[0] < 0 or sorted_slots[-1] >= first_slots[-1]):
            valid = f"[-1, {first_slots[-1]})"
            raise ValueError(f"token slots must lie in {valid}, got {sorted(set(slots))}")
        bounds = [bisect_left(sorted_slots, first) for first in first_slots]  # each class's first sorted token
        n = len(order)
        rows: list[int] = []
        starts: list[int] = []  # per class, its segments' offsets and then its token count
        per_class: list[tuple[Segment, ...]] = []
        for c, first in enumerate(first_slots[:-1]):
            lo, hi = bounds[c], bounds[c + 1]
            class_rows = [slot - first for slot in sorted_slots[lo:hi]]
            segments = find_segments(order[lo:hi], class_rows)
            rows += class_rows
            starts += [s[0] for s in segments] + [hi - lo]
            per_class.append(segments)
        seg_rows = [s[2] for segments in per_class for s in segments]
        if n:
            for buffer, values in (
                (self.host_idx, order),
                (self.host_row, rows),
                (self.host_seg_start, starts),
                (self.host_seg_row, seg_rows),
            ):
                buffer[: len(values)].copy_(torch.tensor(values, dtype=INDEX_DTYPE))
        self.num_tokens, self.num_segments = n, len(seg_rows)
        if n and self.token_idx is not self.host_idx:
            # Non-blocking: a blocking copy would wait for the whole stream; the next fill waits for these alone.
            for dst, src in zip(
                (self.token_idx, self.token_row, self.seg_start, self.seg_row), self._host(), strict=True
            ):
                dst[: src.shape[0]].copy_(src, non_blocking=True)
            self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.copied.record()
        return self._indexes(bounds, per_class)

    def _host(self) -> tuple[torch.Tensor, ...]:
        n, g, c = self.num_tokens, self.num_segments, len(self.class_first_slots) - 1
        return self.host_idx[:n], self.host_row[:n], self.host_seg_start[: g + c], self.host_seg_row[:g]

    def _indexes(self, bounds: list[int], per_class: list[tuple[Segment, ...]]) -> list[LoraIndex | None]:
        indexes: list[LoraIndex | None] = []
        g = 0
        for c, segments in enumerate(per_class):
            lo, hi = bounds[c] - bounds[0], bounds[c + 1] - bounds[0]
            num = len(segments)
            indexes.append(
                LoraIndex(
                    token_idx=self.token_idx[lo:hi],
                    token_row=self.token_row[lo:hi],
                    seg_start=self.seg_start[g + c : g + c + num + 1],
                    seg_row=self.seg_row[g : g + num],
                    max_seg_len=max(e - s for s, e, _, _ in segments),
                    segments=segments,
                )
                if segments
                else None
            )
            g += num
        return indexes
