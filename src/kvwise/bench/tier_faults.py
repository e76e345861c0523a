"""Faults injected into a live server's disk tier while a bench runs: files corrupted and
truncated under it, and the disk filling up and emptying again. (Redis going down mid-run is
tested on its own, in the Redis tier's tests.)

    disk = FillingDiskTier(folder)
    faults = TierFaults(disk)
    faults.start(); ...; faults.stop()
    faults.counts                      # what was injected, by kind
"""

from __future__ import annotations

import errno
import random
import threading
from collections import Counter
from pathlib import Path

from kvwise.tiers.disk import DiskTier


class FillingDiskTier(DiskTier):
    """A disk tier whose writes fail with ENOSPC while `full` is set, as a disk that filled up."""

    full = False

    def put(self, key, block) -> bool:
        if self.full:
            self.stats.refused_puts += 1
            self.last_error = f"OSError: {errno.errorcode[errno.ENOSPC]}"
            return False
        return super().put(key, block)


class TierFaults:
    """A thread that injects one fault every `interval_seconds`, by turns."""

    def __init__(self, disk: FillingDiskTier, interval_seconds: float = 0.5, seed: int = 0):
        self.disk, self.interval_seconds = disk, interval_seconds
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwise-tier-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.disk.full = False

    def _run(self) -> None:
        kinds = ["corrupt", "truncate", "disk_full"]
        while not self._stop.wait(self.interval_seconds):
            kind = self.rng.choice(kinds)
            if getattr(self, f"_{kind}")():
                self.counts[kind] += 1

    def _some_file(self) -> Path | None:
        files = list(self.disk.directory.glob("*/*.kvb"))
        return self.rng.choice(files) if files else None

    def _corrupt(self) -> bool:
        path = self._some_file()
        try:
            data = bytearray(path.read_bytes())
            data[self.rng.randrange(len(data))] ^= 0xFF
            path.write_bytes(bytes(data))
        except (AttributeError, OSError, ValueError):  # no file yet, or the engine deleted it meanwhile
            return False
        return True

    def _truncate(self) -> bool:
        path = self._some_file()
        try:
            with path.open("r+b") as handle:
                handle.truncate(self.rng.randrange(path.stat().st_size))
        except (AttributeError, OSError, ValueError):
            return False
        return True

    def _disk_full(self) -> bool:
        self.disk.full = not self.disk.full  # fills up, and a later turn frees it again
        return self.disk.full
