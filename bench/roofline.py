"""The machine's limits and the decode floors they set, printed first by the engine benchmarks.

A decode step reads every weight once (batch 1 is bound by read bandwidth) and does 2 x params
FLOPs per token (a large batch is bound by GEMM FLOP/s); the step cannot be faster than the larger
of the two. Each decode figure is also given as its ratio to that floor (1.0 = at the limit).
"""

import statistics
import time
from collections.abc import Callable
from typing import TypedDict

import psutil
import torch

from bench.rounds import Spread, spread
from services.worker.engine.linear import LinearFactory, onednn_usable

BATCH_FLOOR_AT = 32  # the batch whose compute floor the roofline line names


class Limits(TypedDict):
    read_gb_s: float
    gemm_gflop_s: float
    weight_mb: float
    params: int


def physical_cores() -> int:
    """The machine's physical cores (hyperthreads share a core's FMA units), else its logical CPUs."""
    return psutil.cpu_count(logical=False) or psutil.cpu_count() or 1


def weights_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each parameter once: a tied embedding is read once per step, as the LM head (the embedding
    lookup reads only the batch's rows)."""
    return list(model.parameters())


def machine_limits(weights: list[torch.Tensor], dtype: torch.dtype, device: str = "cpu") -> Limits:
    """Best of five after a warm-up, at the current torch thread count: read bandwidth of a 512 MiB
    ``torch.sum``, and FLOP/s of a 2048^3 matmul in ``dtype``; ``weights`` are what one decode step reads.

    On CPU the matmul is the faster of torch's ``a @ a`` and a oneDNN-prepacked one (the engine's own
    path): on AMD processors MKL's fp32 GEMM takes a generic path at about half of what oneDNN reaches,
    and a limit the engine can beat is no limit. bf16 on a CPU where oneDNN has no bf16 GEMM (no
    AVX-512) has no bf16 arithmetic to measure: the engine widens to fp32 there (kernels.native's
    panel kernel), so its ceiling is the fp32 GEMM's, and torch's reference bf16 GEMM (several times
    slower) would set a floor the engine beats."""
    x = torch.ones(128 * 2**20, device=device)
    cpu = torch.device(device).type == "cpu"
    if cpu and dtype == torch.bfloat16 and not onednn_usable(dtype):
        dtype = torch.float32
    a = torch.randn(2048, 2048, dtype=dtype, device=device)
    matmuls: list[Callable[[], object]] = [lambda: a @ a]
    if cpu and onednn_usable(dtype):
        packed = LinearFactory("onednn", device, dtype)(a)
        matmuls.append(lambda: packed(a))
    reads, gemms = [], []
    for _ in range(6):
        reads.append(timed(lambda: x.sum(), device))
        gemms.append(min(timed(matmul, device) for matmul in matmuls))
    return {
        "read_gb_s": x.numel() * x.element_size() / min(reads[1:]) / 1e9,
        "gemm_gflop_s": 2 * 2048**3 / min(gemms[1:]) / 1e9,
        "weight_mb": sum(w.numel() * w.element_size() for w in weights) / 1e6,
        "params": sum(w.numel() for w in weights),
    }


class LimitsProbe:
    """The machine's limits, probed at the start and again after every round of a benchmark.

    A shared machine's speed drifts over minutes: the GEMM probe read 125 to 175 GFLOP/s within one
    session, so a single probe at start-up put the same batch-32 step at 56% of its floor in one run
    and 96% in another. A figure is compared with the median of the probes around its own rounds
    (:meth:`mark` before them, :meth:`limits` after), the machine as it was while they ran; a result's
    JSON carries every probe's spread (``roofline_probes``) beside the ratios.
    """

    def __init__(self, weights: list[torch.Tensor], dtype: torch.dtype, device: str = "cpu") -> None:
        self._weights, self._dtype, self._device = weights, dtype, device
        self.samples: list[Limits] = []
        self.sample()

    def sample(self) -> None:
        """Probe once more (about a second): call between rounds, never inside a timed run."""
        self.samples.append(machine_limits(self._weights, self._dtype, self._device))

    def mark(self) -> int:
        """Where a window of rounds starts: the latest probe, the one taken just before them."""
        return len(self.samples) - 1

    def limits(self, since: int = 0) -> Limits:
        """The median of the probes from ``since`` (a :meth:`mark`) on; of all of them by default."""
        window = self.samples[since:]
        return {
            **window[0],
            "read_gb_s": statistics.median(s["read_gb_s"] for s in window),
            "gemm_gflop_s": statistics.median(s["gemm_gflop_s"] for s in window),
        }

    def spread(self) -> "ProbeSpread":
        return {
            "probes": len(self.samples),
            "read_gb_s": spread([s["read_gb_s"] for s in self.samples]),
            "gemm_gflop_s": spread([s["gemm_gflop_s"] for s in self.samples]),
        }

    def line(self) -> str:
        """The closing line: how far the probes ranged over the run, and that the median was used."""
        s = self.spread()
        read, gemm = s["read_gb_s"], s["gemm_gflop_s"]
        return (
            f"Roofline over {s['probes']} probes (start and after each round; each floor from the median of those "
            "around its rounds): "
            f"read {read['median']:.1f} GB/s ({read['min']:.1f}-{read['max']:.1f}), "
            f"GEMM {gemm['median']:.0f} GFLOP/s ({gemm['min']:.0f}-{gemm['max']:.0f})"
        )


class ProbeSpread(TypedDict):
    probes: int
    read_gb_s: Spread
    gemm_gflop_s: Spread


def timed(op: Callable[[], object], device: str) -> float:
    """Seconds of one ``op``, finished on the device (CUDA runs asynchronously)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    op()
    sync()
    return time.perf_counter() - start


def bandwidth_floor_ms(limits: Limits) -> float:
    """Weight bytes / read bandwidth: one step's time to read the weights once."""
    return limits["weight_mb"] / limits["read_gb_s"]  # MB / (GB/s) = ms


def compute_floor_ms(limits: Limits, batch: int) -> float:
    """2 x params x batch / GEMM FLOP/s: one step's matmul time for ``batch`` tokens."""
    return 2 * limits["params"] * batch / (limits["gemm_gflop_s"] * 1e9) * 1e3


def step_floor_ms(limits: Limits, batch: int) -> float:
    """The decode step floor at ``batch``: the larger of the bandwidth and compute floors."""
    return max(bandwidth_floor_ms(limits), compute_floor_ms(limits, batch))


def vs_floor(step_ms: float, limits: Limits, batch: int) -> float:
    """A decode step (or TPOT) at ``batch`` as a multiple of its floor."""
    return step_ms / step_floor_ms(limits, batch)


def roofline(limits: Limits) -> dict[str, float]:
    """The limits and the two floors the roofline line names, for a result's JSON."""
    return {
        "read_gb_s": limits["read_gb_s"],
        "gemm_gflop_s": limits["gemm_gflop_s"],
        "weight_mb": limits["weight_mb"],
        "params": limits["params"],
        "batch1_bandwidth_floor_ms": bandwidth_floor_ms(limits),
        f"batch{BATCH_FLOOR_AT}_compute_floor_ms": compute_floor_ms(limits, BATCH_FLOOR_AT),
    }


def roofline_line(limits: Limits, dtype: str, threads: int, device: str = "cpu") -> str:
    where = f"{threads} threads" if device == "cpu" else device
    return (
        f"Roofline ({dtype}, {where}): read {limits['read_gb_s']:.1f} GB/s, "
        f"GEMM {limits['gemm_gflop_s']:.0f} GFLOP/s; weights {limits['weight_mb']:.0f} MB "
        f"({limits['params'] / 1e6:.1f} M params): batch-1 decode floor {bandwidth_floor_ms(limits):.1f} ms "
        f"(weight bytes / bandwidth), batch-{BATCH_FLOOR_AT} floor {compute_floor_ms(limits, BATCH_FLOOR_AT):.1f} ms "
        f"(2 x params x {BATCH_FLOOR_AT} / FLOP/s)"
    )
