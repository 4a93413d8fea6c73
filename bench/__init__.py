"""Benchmarks: one command each, ratios measured in one run (see BENCHMARKS.md)."""
