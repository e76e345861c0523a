"""Summary statistics shared by the benchmark reports."""

from __future__ import annotations


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank value at `fraction` (0.99 for p99) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]
