"""bench.hop_floor runs its bare pipeline end to end (real nats-server, redis-server, three processes)."""

import json
import subprocess
import sys

from bench.hop_floor import RESULTS


def test_the_bare_pipeline_answers_every_request():
    RESULTS.unlink(missing_ok=True)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.hop_floor",
            "--quick",
            "--requests",
            "5",
            "--compute-ms",
            "5",
            "--settle-ms",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(RESULTS.read_text())
    assert result["n"] == 5 and len(result["raw_ms"]) == 5
    assert 0 < result["p50"] < 1000  # a round trip through five processes, less the worker's compute
