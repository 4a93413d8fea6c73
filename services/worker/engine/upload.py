"""Host -> device copies of a step's small host-side data (indices, per-row parameters) that never
stall the host.

On CUDA a copy from pageable memory synchronises the stream first, waiting for every kernel queued
before it (the forward pass): it goes through pinned memory instead, non-blocking (the caching host
allocator keeps the pinned block until the copy has run). On the CPU the host tensor is the tensor.
"""

import torch


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """host: a CPU tensor -> the same values on ``device``, without waiting for the device."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_device(
    values: list[int] | list[float], device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A 1-D tensor of ``values`` on ``device`` (int64 or fp32 unless ``dtype``), uploaded without a sync."""
    return upload(torch.tensor(values, dtype=dtype), device)
