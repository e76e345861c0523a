"""The benches' peak-memory meter: what a block of work needed above what the process held."""

from __future__ import annotations

import time

import pytest
import torch

from kvwise.bench.niah_report import _cell, _peak
from kvwise.bench.peak_memory import SAMPLE_SECONDS, PeakMemory

pytestmark = pytest.mark.timeout(60)


def test_a_large_temporary_tensor_shows_in_the_peak():
    with PeakMemory("cpu") as small:
        torch.ones(1000).sum()
    with PeakMemory("cpu") as large:
        buffer = torch.ones(64 * 2**20)  # 256 MB, touched so it is resident
        buffer.add_(1)
        # held until the sampler has run three times since: on a loaded machine its thread may not
        # run for tens of milliseconds (a trial's tensors live far longer than this fill)
        taken, deadline = large.samples, time.monotonic() + 10
        while large.samples < taken + 3 and time.monotonic() < deadline:
            time.sleep(SAMPLE_SECONDS)
        del buffer
    assert large.peak_bytes is not None and large.peak_bytes >= 200 * 2**20
    assert small.peak_bytes < 64 * 2**20


def test_the_niah_cell_reports_the_largest_peak():
    rows = [
        {"correct": True, "kv_bytes": 1, "full_kv_bytes": 2, "full16_kv_bytes": 1, "seconds": 1.0, "peak_bytes": p}
        for p in (2**30, 3 * 2**29)
    ]
    cell = _cell(rows)
    assert cell["peak_bytes"] == 3 * 2**29 and _peak(cell) == ", peak 1.50 GB"
    assert _peak(_cell([{**rows[0], "peak_bytes": None}])) == ""
