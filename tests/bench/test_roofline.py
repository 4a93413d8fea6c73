"""bench.roofline: the decode floors a machine's bandwidth and FLOP/s set, and a step's ratio to them."""

import statistics

import pytest
import torch

from bench.roofline import (
    Limits,
    LimitsProbe,
    bandwidth_floor_ms,
    compute_floor_ms,
    machine_limits,
    physical_cores,
    roofline,
    roofline_line,
    step_floor_ms,
    vs_floor,
    weights_of,
)

LIMITS: Limits = {"read_gb_s": 10.0, "gemm_gflop_s": 100.0, "weight_mb": 500.0, "params": 125_000_000}


def test_the_step_floor_is_weight_reads_at_batch_one_and_flops_at_a_large_batch():
    assert bandwidth_floor_ms(LIMITS) == pytest.approx(50.0)  # 0.5 GB / 10 GB/s
    assert compute_floor_ms(LIMITS, 1) == pytest.approx(2.5)  # 2 x 125e6 / 100e9
    assert step_floor_ms(LIMITS, 1) == pytest.approx(50.0)
    assert step_floor_ms(LIMITS, 32) == pytest.approx(80.0)  # 2 x 125e6 x 32 / 100e9
    assert step_floor_ms(LIMITS, 20) == pytest.approx(50.0)  # the two floors cross at batch 20


def test_a_decode_figure_is_a_multiple_of_its_batchs_floor():
    assert vs_floor(50.0, LIMITS, 1) == pytest.approx(1.0)  # at the limit
    assert vs_floor(200.0, LIMITS, 32) == pytest.approx(2.5)


def test_the_json_and_the_line_name_both_floors():
    figures = roofline(LIMITS)
    assert figures["batch1_bandwidth_floor_ms"] == pytest.approx(50.0)
    assert figures["batch32_compute_floor_ms"] == pytest.approx(80.0)
    assert {k: figures[k] for k in LIMITS} == LIMITS
    line = roofline_line(LIMITS, "float32", 2)
    assert line.startswith("Roofline (float32, 2 threads): read 10.0 GB/s, GEMM 100 GFLOP/s")
    assert "batch-1 decode floor 50.0 ms" in line and "batch-32 floor 80.0 ms" in line


def test_a_tied_embedding_counts_once():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert sum(w.numel() for w in weights_of(model)) == 40


def test_the_measured_limits_are_positive_and_count_the_weights():
    limits = machine_limits([torch.zeros(1000), torch.zeros(10, 10)], torch.float32)
    assert limits["read_gb_s"] > 0 and limits["gemm_gflop_s"] > 0
    assert limits["params"] == 1100 and limits["weight_mb"] == pytest.approx(4400 / 1e6)
    assert physical_cores() >= 1


def test_bf16_without_a_bf16_gemm_measures_the_fp32_gemm_the_engine_widens_to(monkeypatch: pytest.MonkeyPatch):
    """Where oneDNN has no bf16 GEMM (no AVX-512) the engine's bf16 projections are fp32 arithmetic
    (the panel kernel widens), so the bf16 ceiling is the fp32 GEMM: never torch's reference bf16
    GEMM, which the engine beats several times over."""
    import bench.roofline as roofline_module

    made: list[torch.dtype] = []
    real_randn = torch.randn

    def randn(*shape, **kwargs):
        if shape == (2048, 2048):  # the matmul's operand
            made.append(kwargs.get("dtype", torch.float32))
        return real_randn(*shape, **kwargs)

    monkeypatch.setattr(roofline_module, "onednn_usable", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(roofline_module.torch, "randn", randn)
    # which GEMM is measured, not how fast it ran (the test above times a real one): every op takes 1 s
    monkeypatch.setattr(roofline_module, "timed", lambda op, device: 1.0)
    limits = machine_limits([torch.zeros(10, dtype=torch.bfloat16)], torch.bfloat16)
    assert made == [torch.float32] and limits["gemm_gflop_s"] == pytest.approx(2 * 2048**3 / 1e9)
    assert limits["weight_mb"] == pytest.approx(20 / 1e6)  # the weights are still counted in bf16


def test_a_probe_takes_the_median_of_its_samples_and_reports_their_spread(monkeypatch: pytest.MonkeyPatch):
    """A figure is compared with the probes around its own rounds, not whichever moment the first
    probe landed on. The probes are scripted (distinct figures, so a median cannot pass by a tie): what
    one measures is machine_limits' test above, and four real ones took 9 s of the fast tier."""
    import bench.roofline as roofline_module

    weights = [torch.zeros(1000)]
    figures = iter([(30.0, 300.0), (10.0, 100.0), (40.0, 250.0), (20.0, 200.0)])  # (read GB/s, GEMM GFLOP/s)

    def scripted(ws: list[torch.Tensor], dtype: torch.dtype, device: str) -> Limits:
        assert ws is weights and dtype == torch.float32 and device == "cpu"
        read, gemm = next(figures)
        return {"read_gb_s": read, "gemm_gflop_s": gemm, "weight_mb": 4000 / 1e6, "params": 1000}

    monkeypatch.setattr(roofline_module, "machine_limits", scripted)
    probe = LimitsProbe(weights, torch.float32)
    probe.sample()
    since = probe.mark()
    assert since == 1
    probe.sample()
    probe.sample()
    assert len(probe.samples) == 4
    gemm = [s["gemm_gflop_s"] for s in probe.samples]
    read = [s["read_gb_s"] for s in probe.samples]
    limits = probe.limits()
    assert limits["gemm_gflop_s"] == statistics.median(gemm) and limits["read_gb_s"] == statistics.median(read)
    assert limits["params"] == 1000 and limits["weight_mb"] == pytest.approx(4000 / 1e6)
    window = probe.limits(since)
    assert window["gemm_gflop_s"] == sorted(gemm[1:])[1] and window["read_gb_s"] == sorted(read[1:])[1]
    spread = probe.spread()
    assert spread["probes"] == 4
    assert spread["gemm_gflop_s"] == {"min": min(gemm), "median": statistics.median(gemm), "max": max(gemm)}
    assert spread["read_gb_s"] == {"min": min(read), "median": statistics.median(read), "max": max(read)}
    assert limits["gemm_gflop_s"] == 225.0 and window["read_gb_s"] == 20.0  # the figures, not only their order
    assert probe.line().startswith("Roofline over 4 probes")
    gemm_text = f"GEMM {statistics.median(gemm):.0f} GFLOP/s ({min(gemm):.0f}-{max(gemm):.0f})"
    assert gemm_text in probe.line()
