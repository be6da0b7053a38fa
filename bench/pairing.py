"""Paired timing: each method's step over the unmodified step timed in the same repeat.

On this machine a slow spell slows both steps of a repeat, where the ratio of two medians
takes each from its own spells. Pure Python (no torch), so the report can use it too.
"""

from __future__ import annotations

import statistics


def paired_ratios(steps_ms: list[float], against_ms: list[float]) -> list[float]:
    """Each repeat's step over ``against``'s step in the same repeat."""
    return [a / b for a, b in zip(steps_ms, against_ms, strict=True)]


def paired_overhead(steps_ms: list[float], baseline_steps_ms: list[float]) -> float:
    """The median of the paired ratios to the unmodified step, minus one."""
    return statistics.median(paired_ratios(steps_ms, baseline_steps_ms)) - 1
