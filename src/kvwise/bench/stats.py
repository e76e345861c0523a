"""Summary statistics shared by the benchmark reports."""

from __future__ import annotations

import numpy as np


def percentile(values: list[float], fraction: float) -> float:
    """The value at `fraction` (0.99 for p99) of `values`, interpolated linearly between the two
    nearest samples, as numpy and `vllm bench serve` compute it."""
    if not len(values):
        raise ValueError("a percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), 100 * fraction))
