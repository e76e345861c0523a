"""The benches' peak-memory meter: what a block of work needed above what the process held."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvwise.bench.niah_report import _cell, _peak

pytestmark = pytest.mark.timeout(60)


_LARGE_AND_SMALL = """
import time
import torch
from kvwise.bench.peak_memory import SAMPLE_SECONDS, PeakMemory

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
print(small.peak_bytes, large.peak_bytes)
"""


def test_a_large_temporary_tensor_shows_in_the_peak():
    # In a fresh process: the meter sees growth of the resident set, and a long test process may
    # hold freed memory that a new tensor reuses without growing it.
    done = subprocess.run([sys.executable, "-c", _LARGE_AND_SMALL], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    small, large = (int(field) for field in done.stdout.split())
    assert large >= 200 * 2**20
    assert small < 64 * 2**20


def test_the_niah_cell_reports_the_largest_peak():
    rows = [
        {"correct": True, "kv_bytes": 1, "full_kv_bytes": 2, "full16_kv_bytes": 1, "seconds": 1.0, "peak_bytes": p}
        for p in (2**30, 3 * 2**29)
    ]
    cell = _cell(rows)
    assert cell["peak_bytes"] == 3 * 2**29 and _peak(cell) == ", peak 1.50 GB"
    assert _peak(_cell([{**rows[0], "peak_bytes": None}])) == ""
