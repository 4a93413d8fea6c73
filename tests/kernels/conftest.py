"""Run the Triton kernels on CPU under the interpreter, or compiled on a GPU with LF_KERNEL_DEVICE=cuda
(bench/gpu_check.sh): the choice must be made before any kernel is decorated."""

import os
from collections.abc import Iterator

os.environ["TRITON_INTERPRET"] = "0" if os.environ.get("LF_KERNEL_DEVICE", "cpu").startswith("cuda") else "1"

import pytest
import torch

DEVICE = torch.device(os.environ.get("LF_KERNEL_DEVICE", "cpu"))
ON_CPU = DEVICE.type == "cpu"

# Absolute and relative tolerance of each dtype against the fp32 loop, scaled for outputs of order 1.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1.6e-2),
}
DTYPES = list(TOLERANCE)


def spread_rows(kind: str, num_tokens: int, num_rows: int, gen: torch.Generator) -> torch.Tensor:
    """Per-token stack rows, spread over the batch the way punica's tests sweep them."""
    if kind == "distinct":  # as distinct as the rows allow
        return torch.randperm(max(num_rows, num_tokens), generator=gen)[:num_tokens] % num_rows
    if kind == "identical":
        return torch.full((num_tokens,), int(torch.randint(num_rows, (1,), generator=gen)))
    if kind == "uniform":
        return torch.randint(num_rows, (num_tokens,), generator=gen)
    if kind == "zipf":
        weights = 1.0 / torch.arange(1, num_rows + 1, dtype=torch.float64)
        return torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    if kind == "skewed":
        rows = torch.zeros(num_tokens, dtype=torch.int64)
        rows[-1:] = num_rows - 1
        return rows
    if kind == "mixed":
        rows = torch.randint(-1, num_rows, (num_tokens,), generator=gen)
        rows[::3] = -1
        return rows
    raise ValueError(kind)


SPREADS = ["distinct", "identical", "uniform", "zipf", "skewed", "mixed"]
RANKS = [8, 16, 32, 64]
# Every rank and spread in fp32; the half dtypes at the smallest and largest rank keep the interpreter quick.
KERNEL_CASES = [
    pytest.param(dtype, rank, spread, id=f"{str(dtype)[6:]}-r{rank}-{spread}")
    for dtype in DTYPES
    for rank in (RANKS if dtype == torch.float32 else [RANKS[0], RANKS[-1]])
    for spread in SPREADS
]


def make_weights(
    num_rows: int, in_features: int, rank: int, out_features: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [rows, in, r], b [rows, r, out], scale [rows] with outputs of order 1."""
    a = (torch.randn(num_rows, in_features, rank, generator=gen) / in_features**0.5).to(dtype)
    b = (torch.randn(num_rows, rank, out_features, generator=gen) / rank**0.5).to(dtype)
    scale = torch.rand(num_rows, generator=gen) + 0.5
    return a, b, scale


def loop_lora(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """Ground truth: y + the delta, one token at a time in fp32."""
    out = y.float().clone()
    for t, row in enumerate(rows.tolist()):
        if row >= 0:
            out[t] += float(scale[row]) * (x[t].float() @ a[row].float()) @ b[row].float()
    return out


@pytest.fixture(autouse=True)
def on_device() -> Iterator[None]:
    """Every tensor a test creates lands on DEVICE: compiled kernels take CUDA tensors only."""
    if ON_CPU:
        yield
        return
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(None)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(0)
