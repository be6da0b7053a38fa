"""How far a median of noisy timings can be trusted, assuming nothing of the noise's shape.

Used by ``monet profile`` (how far the step's noise may move checkpoint's prices) and by the
benchmarks (each point's interval).
"""

from __future__ import annotations

from math import comb


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
