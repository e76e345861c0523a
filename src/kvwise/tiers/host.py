"""Host RAM tier: a byte-bounded LRU of blocks in (pinned, when CUDA is present) CPU memory."""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvwise.tiers.base import Tier


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int):
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def get(self, key: bytes) -> torch.Tensor | None:
        self.stats.gets += 1
        block = self._blocks.get(key)
        if block is None:
            return None
        self._blocks.move_to_end(key)
        self.stats.hits += 1
        return block

    def put(self, key: bytes, block: torch.Tensor) -> bool:
        size = block.nbytes
        if size > self.capacity_bytes:
            self.stats.refused_puts += 1
            return False
        self.delete(key)
        while self.stats.bytes_held + size > self.capacity_bytes:
            _, evicted = self._blocks.popitem(last=False)
            self.stats.bytes_held -= evicted.nbytes
        copy = block.detach().to("cpu", copy=True)
        if torch.cuda.is_available():
            copy = copy.pin_memory()  # faster copies back to the device
        self._blocks[key] = copy
        self.stats.bytes_held += size
        self.stats.puts += 1
        return True

    def exists(self, key: bytes) -> bool:
        return key in self._blocks

    def delete(self, key: bytes) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.stats.bytes_held -= block.nbytes
            self.stats.deletes += 1
