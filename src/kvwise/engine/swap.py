"""`HostSwap`: preemption by spilling a request's blocks to host memory instead of recomputing.

When the pool runs short, the scheduler preempts the newest running request. With a swap space,
its blocks' keys and values are copied to host RAM (pinned on CUDA, so the copy back is fast),
its device blocks are released, and when it is admitted again it gets fresh blocks, the copy
comes back, and it continues where it stopped: no prefill is repeated. Without room in the swap
space it is recomputed, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.kv.paged import PagedKVStorage


@dataclass
class SwappedKV:
    """keys, values: [num_layers, num_blocks, block_size, kv_heads, head_dim] in host memory."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class HostSwap:
    def __init__(self, storage: PagedKVStorage, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"swap space must be >= 0 bytes, got {capacity_bytes}")
        self.storage, self.capacity_bytes = storage, capacity_bytes
        self.block_bytes = storage.block_bytes
        self.used_bytes = 0
        self.swapped_out_blocks = self.swapped_in_blocks = 0
        self._pin = storage.keys[0].device.type == "cuda"

    def can_hold(self, num_blocks: int) -> bool:
        return self.used_bytes + num_blocks * self.block_bytes <= self.capacity_bytes

    def swap_out(self, blocks: list[int]) -> SwappedKV:
        """Copy `blocks` to host memory (the caller then releases them, which zeroes them)."""
        copies = []
        for gathered in self.storage.read_blocks(blocks):  # [num_layers, n, block_size, kv_heads, head_dim]
            host = gathered.to("cpu")
            if self._pin:
                pinned = host.pin_memory()
                host.zero_()  # the pageable staging copy holds no KV once pinned
                host = pinned
            if gathered.data_ptr() != host.data_ptr():
                gathered.zero_()  # nor does the device scratch copy the allocator will hand out again
            copies.append(host)
        swapped = SwappedKV(*copies)
        self.used_bytes += swapped.nbytes
        self.swapped_out_blocks += len(blocks)
        return swapped

    def swap_in(self, swapped: SwappedKV, blocks: list[int]) -> None:
        """Write a swapped request's KV into freshly allocated `blocks` and free the host copy."""
        # blocking copies: drop() zeroes the host copy next, which must not race a pending transfer
        self.storage.write_blocks(blocks, swapped.keys, swapped.values)
        self.drop(swapped)
        self.swapped_in_blocks += len(blocks)

    def drop(self, swapped: SwappedKV) -> None:
        """Forget a host copy (its request was cancelled); host memory holds no stale KV."""
        self.used_bytes -= swapped.nbytes
        swapped.keys.zero_()
        swapped.values.zero_()
