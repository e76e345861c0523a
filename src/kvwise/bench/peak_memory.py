"""Peak memory over a block of work, for the benches' long-context trials.

On CUDA, the allocator's own peak. On a CPU there is no allocator to ask, so a thread samples the
process's resident set every few milliseconds (torch releases the GIL in its kernels, so the
samples land during the big ones) and the peak is reported above what the process held at the
start: the memory the trial itself needed.
"""

from __future__ import annotations

import os
import threading

import torch

SAMPLE_SECONDS = 0.002


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux
        return None


class PeakMemory:
    """`with PeakMemory(device) as meter: ...`, then `meter.peak_bytes` (None where unmeasurable)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak_bytes: int | None = None
        self.samples = 0  # resident-set samples taken so far (CPU)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._start = _resident_bytes()
        if self._start is not None:
            self._highest = self._start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._highest = max(self._highest, _resident_bytes() or 0)
            self.samples += 1

    def __exit__(self, *exc_info) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._highest = max(self._highest, _resident_bytes() or 0)
            self.peak_bytes = self._highest - self._start
