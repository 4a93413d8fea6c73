"""GNU OpenMP's wait policy for the built-in engine's processes (the worker, the benchmarks run as
commands): how long a team's thread spins between parallel regions before it sleeps (``GOMP_SPINCOUNT``),
read once when torch loads the runtime, so set before the first ``import torch``. An operator's own value
is kept; the vLLM worker (``LF_WORKER_ENGINE=vllm``) keeps GNU OpenMP's default.

The worker's step thread is its process's one OpenMP team (kernels/omp_threads.py), so GNU OpenMP does
not throttle it, and its default spin (300,000 turns, milliseconds) is a trap on a machine that also
runs other processes: a bf16 batch-1 step of the stack on the shared 2-core box took 17 ms quiet but
600-850 ms beside one busy process, each region's barrier spinning out the time slices its partner
waited for. 1,000 turns: 20 ms quiet and 31 ms beside the busy process (5,000: 18.7 and 48 ms; 100,
about the throttled spin the worker had before it held one team: 28 ms quiet).
"""

import os

SPIN_COUNT = 1000


def default_spin_count() -> None:
    """``GOMP_SPINCOUNT`` to SPIN_COUNT unless set, or the worker runs vLLM; call before torch is imported."""
    if os.environ.get("LF_WORKER_ENGINE", "builtin") == "builtin":
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
