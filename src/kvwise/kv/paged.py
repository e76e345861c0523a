"""`PagedKVStorage`: the engine's KV memory, one pool of fixed-size blocks per layer.

    keys[layer], values[layer]: [num_blocks, block_size, num_kv_heads, head_dim] on the model's device
    (views of all_keys, all_values: [num_layers, num_blocks, block_size, num_kv_heads, head_dim])

A token lives at slot `block * block_size + offset`; a sequence reads its blocks through a block
table. Whole blocks move through one API, `read_blocks` / `write_blocks` (host swap, the prefix
tiers and the quantized pool all use it). Block ids come from `core.BlockPool`; `attach(pool)`
registers `zero` as the pool's release hook, so a block's keys and values are overwritten with
zeros in the same call that drops its last reference, before the pool can hand it to anyone else
(another request or tenant).
"""

from __future__ import annotations

import torch

from kvwise.core.block_pool import BlockPool

# The CPU kernels that copy tier entries into blocks are built by the engine (engine/cpu_kernel.py),
# a floor above this one, which registers them here: writer(pool [2, layers, blocks, ...],
# block_ids [n] int64, entries) -> whether it wrote them (False: no kernel on this machine).
_entry_writer = None


def register_entry_writer(writer) -> None:
    global _entry_writer
    _entry_writer = writer


def _plain_cpu(entry: torch.Tensor, dtype: torch.dtype) -> bool:
    return entry.device.type == "cpu" and entry.dtype == dtype and entry.is_contiguous()


class PagedKVStorage:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        # one tensor for all layers, so that a cell index (`cells`) can name any layer's token, and
        # keys and values side by side in one more, so that a whole block moves in one copy
        self._kv = torch.zeros((2, *shape), dtype=dtype, device=device)
        self.all_keys, self.all_values = self._kv[0], self._kv[1]
        self.keys, self.values = list(self.all_keys.unbind(0)), list(self.all_values.unbind(0))

    def attach(self, pool: BlockPool) -> None:
        """Zero blocks whenever `pool` frees them."""
        if pool.num_blocks != self.keys[0].shape[0] or pool.block_size != self.block_size:
            raise ValueError("the pool and the storage disagree on the number or size of blocks")
        pool.on_release(self.zero)

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store tokens. slots: [n] int64 (block * block_size + offset); keys, values: [n, num_kv_heads, head_dim].
        A contiguous source and `index_copy_`: on CPU, 3-10x faster than `pool[slots] = keys` from
        the attention's transposed view (which took 2 ms of each float32 decode step of the
        embedded model)."""
        self.keys[layer].view(-1, *keys.shape[1:]).index_copy_(0, slots, keys.contiguous())
        self.values[layer].view(-1, *values.shape[1:]).index_copy_(0, slots, values.contiguous())

    def read_blocks(self, block_ids: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of whole blocks of every layer: keys, values [num_layers, n, block_size, num_kv_heads, head_dim]."""
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        return (
            torch.stack([layer.index_select(0, index) for layer in self.keys]),
            torch.stack([layer.index_select(0, index) for layer in self.values]),
        )

    def write_blocks(self, block_ids: list[int] | torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite whole blocks of every layer. keys, values: [num_layers, n, block_size, num_kv_heads,
        head_dim] on any device, copied layer by layer (blocking: a host source may be reused at once)."""
        device = self.keys[0].device
        index = torch.as_tensor(block_ids, dtype=torch.long, device=device)
        for layer in range(len(self.keys)):
            self.keys[layer].index_copy_(0, index, keys[layer].to(device))
            self.values[layer].index_copy_(0, index, values[layer].to(device))

    def write_entries(self, block_ids: list[int], entries: list[torch.Tensor]) -> None:
        """Overwrite whole blocks from tier entries, each [num_layers, 2 (keys, values), block_size,
        num_kv_heads, head_dim] on any device: on CPU one memcpy per block and layer, in the CPU
        kernels where they are built; else one copy per block, keys and values of every layer at
        once (a prefix restored from a tier moves at the speed of its bytes)."""
        writer = _entry_writer
        if writer is not None and self._kv.device.type == "cpu" and all(_plain_cpu(e, self._kv.dtype) for e in entries):
            if writer(self._kv, torch.tensor(block_ids, dtype=torch.long), entries):
                return
        for block, entry in zip(block_ids, entries):
            self._kv[:, :, block].copy_(entry.transpose(0, 1))  # [2, layers, ...] <- [layers, 2, ...]

    def read_entry(self, block: int) -> torch.Tensor:
        """A copy of one block as a tier entry: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return self._kv[:, :, block].transpose(0, 1).contiguous()

    def gather(self, layer: int, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's blocks in order: keys, values [len(block_table) * block_size, num_kv_heads, head_dim]."""
        keys, values = self.keys[layer][block_table], self.values[layer][block_table]
        return keys.flatten(0, 1), values.flatten(0, 1)

    def cells(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as [num_layers * num_blocks * block_size * num_kv_heads, head_dim] views:
        cell ((layer * num_blocks + block) * block_size + offset) * num_kv_heads + head."""
        dim = self.all_keys.shape[-1]
        return self.all_keys.view(-1, dim), self.all_values.view(-1, dim)

    def zero(self, block_ids: list[int]) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.keys[0].device)
        self._kv.index_fill_(2, index, 0)  # keys and values of every layer in one call

    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in (*self.keys, *self.values))

    @property
    def block_bytes(self) -> int:
        """One block: keys and values of every layer."""
        return self.nbytes() // self.keys[0].shape[0]

    @property
    def token_bytes(self) -> int:
        """One token slot: keys and values of every layer."""
        return self.block_bytes // self.block_size
