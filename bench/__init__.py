"""Benchmarks for monet (run from the repository root, e.g. ``python bench/solver_quality.py``)."""
