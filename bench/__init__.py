"""Benchmarks: one command each, ratios measured in one run (see BENCHMARKS.md)."""

import sys

from shared.openmp_env import default_spin_count

if "pytest" not in sys.modules:  # a bench run as a command: its own engine spins as the worker's does
    default_spin_count()
