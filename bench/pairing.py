"""Paired timing: each method's step over the unmodified step timed in the same repeat.

On this machine a slow spell slows both steps of a repeat, where the ratio of two medians
takes each from its own spells. Pure Python (no torch), so the report can use it too.
"""

from __future__ import annotations

import statistics
from math import comb


def paired_ratios(steps_ms: list[float], against_ms: list[float]) -> list[float]:
    """Each repeat's step over ``against``'s step in the same repeat."""
    return [a / b for a, b in zip(steps_ms, against_ms, strict=True)]


def paired_overhead(steps_ms: list[float], baseline_steps_ms: list[float]) -> float:
    """The median of the paired ratios to the unmodified step, minus one."""
    return statistics.median(paired_ratios(steps_ms, baseline_steps_ms)) - 1


def median_interval(values: list[float], confidence: float) -> tuple[float, float]:
    """The order statistics around the median of ``values`` that hold the true median with at
    least ``confidence`` (the sign test's interval, which assumes nothing of how this
    machine's noise is shaped); the extremes when there are too few values for that."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")
    # The largest k with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2: the interval runs
    # from the k-th smallest to the k-th largest.
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n // 2 and below + comb(n, k) / 2**n <= tail:
        below += comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]
