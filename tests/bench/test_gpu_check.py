"""bench/gpu_check.sh: it parses, runs every step of the GPU check, never changes the GPU's settings,
and on a machine without a GPU stops at once with a clear message."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


def test_the_script_is_executable_and_parses():
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_it_names_each_step_with_its_command():
    text = SCRIPT.read_text()
    steps = {
        "kernels": r"LF_KERNEL_DEVICE=cuda TRITON_INTERPRET=0 .*-m pytest.*\s+tests/kernels/test_bgmv.py tests/kernels/test_sgmv.py",
        "cuda_tests": r"-m pytest .*-m cuda \\\s+tests/worker/engine/test_cuda_graph.py tests/worker/engine/test_host_syncs.py",
        "engine_bf16": r"-m bench.engine --quick --device cuda --dtype bfloat16 --out \"\$OUT/engine.json\"",
        "engine_graphs": r"-m bench.engine --quick --device cuda --dtype bfloat16 --cuda-graphs \\\s+--out \"\$OUT/engine_graphs.json\"",
        "multilora": r"-m bench.multilora --device cuda --out \"\$OUT/multilora.json\"",
        "engine_peers": r"-m bench.engine_peers --quick --out \"\$OUT/engine_peers.json\"",
    }
    for name, command in steps.items():
        assert re.search(rf"run_step {name} .*{command}", text, re.DOTALL), name
    assert "OUT=bench/results/gpu" in text
    summary = re.search(r"for name in ([\w ]+); do", text)
    assert summary is not None and summary.group(1).split() == list(steps)  # every step is in the summary


def test_its_cuda_step_selects_the_gpu_tests() -> None:
    """The cuda_tests step is not empty: its files hold tests marked ``cuda`` (skipped here without a GPU)."""
    files = ["tests/worker/engine/test_cuda_graph.py", "tests/worker/engine/test_host_syncs.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "cuda", *files],
        cwd=SCRIPT.parents[1],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(collected) >= 2 and all(line.startswith(tuple(files)) for line in collected), run.stdout


def test_it_only_queries_the_gpu():
    calls = [line for line in SCRIPT.read_text().splitlines() if re.search(r"\bnvidia-smi\b(?! is)", line)]
    assert calls
    for line in calls:
        assert not re.search(
            r"\s-(pm|lgc|rgc|lmc|ac|rac|pl|r|mig|c|e)\b|--(reset|persistence|applications|lock|power)", line
        ), line


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_a_gpu_it_stops_before_any_step():
    run = subprocess.run([str(SCRIPT)], capture_output=True, text=True, check=False, timeout=60)
    assert run.returncode == 2
    assert "no CUDA GPU here" in run.stderr and "==" not in run.stdout
