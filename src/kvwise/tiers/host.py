"""Host RAM tier: a byte-bounded LRU of blocks in (pinned, when CUDA is present) CPU memory.

Blocks are zeroed when evicted or deleted, and the pageable staging copy made before pinning
is zeroed too, so no KV of a request outlives its entry in host memory. `get` returns a copy,
so zeroing an entry never reaches a block a caller is still reading. `borrow` lends the entries
themselves, for a restore that copies them once into the device pool: while lent, an entry is
neither evicted nor zeroed (a delete meanwhile zeroes it when it comes back). A lock makes the
tier safe for a prefetch thread beside the engine."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from kvwise.tiers.base import Tier


class HostTier(Tier):
    name = "host"
    lends = True

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lent: Counter[bytes] = Counter()  # key -> borrows in progress
        self._deleted_while_lent: list[torch.Tensor] = []  # zeroed when their borrows end
        self._lock = threading.RLock()

    def get(self, key: bytes) -> torch.Tensor | None:
        with self._lock:
            self.stats.gets += 1
            block = self._blocks.get(key)
            if block is None:
                return None
            self._blocks.move_to_end(key)
            self.stats.hits += 1
            return block.clone()

    @contextmanager
    def borrow(self, keys: Sequence[bytes]) -> Iterator[list[torch.Tensor | None]]:
        """The entries themselves (no copy; read them, never write), kept from eviction and
        zeroing until the `with` ends."""
        with self._lock:
            lent = []
            for key in keys:
                self.stats.gets += 1
                block = self._blocks.get(key)
                if block is not None:
                    self._blocks.move_to_end(key)
                    self._lent[key] += 1
                    self.stats.hits += 1
                lent.append(block)
        try:
            yield lent
        finally:
            with self._lock:
                for key, block in zip(keys, lent):
                    if block is not None:
                        self._lent[key] -= 1
                        if not self._lent[key]:
                            del self._lent[key]
                if not self._lent:
                    for block in self._deleted_while_lent:
                        block.zero_()
                    self._deleted_while_lent.clear()

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)

    def put(self, key: bytes, block: torch.Tensor) -> bool:
        with self._lock:
            return self._put(key, block)

    def _put(self, key: bytes, block: torch.Tensor) -> bool:
        size = block.nbytes
        if size > self.capacity_bytes:
            self.stats.refused_puts += 1
            return False
        self.delete(key)
        while self.stats.bytes_held + size > self.capacity_bytes:
            # the least recently used entry not lent (lent ones were just used: at the end)
            oldest = next((name for name in self._blocks if name not in self._lent), None)
            if oldest is None:  # what is left is lent to a restore
                self.stats.refused_puts += 1
                return False
            evicted = self._blocks.pop(oldest)
            self.stats.bytes_held -= evicted.nbytes
            evicted.zero_()  # evicted KV leaves no residue in host memory
        copy = block.detach().to("cpu", copy=True)
        if torch.cuda.is_available():
            pinned = copy.pin_memory()  # faster copies back to the device
            copy.zero_()  # the pageable staging copy holds no KV once pinned
            copy = pinned
        self._blocks[key] = copy
        self.stats.bytes_held += size
        self.stats.puts += 1
        return True

    def exists(self, key: bytes) -> bool:
        return key in self._blocks

    def delete(self, key: bytes) -> None:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is not None:
                if key in self._lent:  # a restore reads it: zeroed when it comes back
                    self._deleted_while_lent.append(block)
                else:
                    block.zero_()
                self.stats.bytes_held -= block.nbytes
                self.stats.deletes += 1
