"""`BlockPool`: fixed-size KV blocks with reference counts and an O(1) LRU free queue.

Blocks are plain ids; the tensors live in `kv/` (paged storage), which registers a release hook
so a block's memory is zeroed the moment its last reference goes, before it can be handed out
again. Check, then act: `can_allocate(n)` before `allocate(n)`, and `allocate` never fails
halfway.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class PoolStats:
    total: int
    free: int
    used: int
    allocations: int
    releases: int

    @property
    def usage(self) -> float:
        return self.used / self.total if self.total else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently released first: OrderedDict gives O(1) pop, append and removal.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_map = bytearray(b"\x01") * num_blocks  # 1 where free: finds contiguous runs at C speed
        self._release_hooks: list[Callable[[list[int]], None]] = []
        self._allocations = self._releases = 0

    def on_release(self, hook: Callable[[list[int]], None]) -> None:
        """Call `hook(block_ids)` whenever blocks lose their last reference (to zero their memory)."""
        self._release_hooks.append(hook)

    # ---- check, then act ---------------------------------------------------------------------
    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one reference each, least recently released first."""
        if not self.can_allocate(count):
            raise ValueError(f"cannot allocate {count} blocks: {len(self._free)} of {self.num_blocks} are free")
        return self._take([self._free.popitem(last=False)[0] for _ in range(count)], popped=True)

    def allocate_contiguous(self, count: int) -> list[int] | None:
        """`count` consecutive block ids (the lowest free run), or None when no run is that long."""
        start = self._free_map.find(b"\x01" * count) if count > 0 else -1
        return None if start < 0 else self._take(list(range(start, start + count)))

    def _take(self, blocks: list[int], popped: bool = False) -> list[int]:
        for block in blocks:
            if not popped:
                del self._free[block]
            self._free_map[block] = 0
            self.ref_counts[block] = 1
        self._allocations += len(blocks)
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Add a reference to blocks already in use (a prefix shared by another holder)."""
        blocks = list(blocks)
        for block in blocks:
            if self.ref_counts[block] == 0:
                raise ValueError(f"block {block} is free; allocate it instead of adding a reference")
        for block in blocks:
            self.ref_counts[block] += 1

    def release(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each block; returns the blocks that became free."""
        blocks = list(blocks)
        for block, count in Counter(blocks).items():
            if self.ref_counts[block] < count:
                raise ValueError(f"block {block} is already free")
        freed = []
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                freed.append(block)
        if freed:
            for hook in self._release_hooks:
                hook(freed)
            for block in freed:
                self._free[block] = None
                self._free_map[block] = 1
            self._releases += len(freed)
        return freed

    # ---- reports -----------------------------------------------------------------------------
    def is_free(self, block: int) -> bool:
        return block in self._free

    @property
    def num_free(self) -> int:
        return len(self._free)

    def stats(self) -> PoolStats:
        free = len(self._free)
        return PoolStats(self.num_blocks, free, self.num_blocks - free, self._allocations, self._releases)
