"""Percentiles as numpy and `vllm bench serve` report them: interpolated, so p99 of a few samples is
not simply the largest."""

from __future__ import annotations

import pytest

from kvwise.bench.stats import percentile


def test_percentiles_interpolate_linearly():
    values = [float(v) for v in range(1, 25)]  # 24 samples: 1..24
    assert percentile(values, 0.5) == pytest.approx(12.5)
    assert percentile(values, 0.99) == pytest.approx(23.77)  # between 23 and 24, not the max
    assert percentile([3.0], 0.99) == 3.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 0.5)
