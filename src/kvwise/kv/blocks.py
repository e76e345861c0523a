"""Quantized KV blocks: the paged form of a quantizer, for an engine's block pool.

A block holds `block_size` consecutive tokens of every KV head of one layer and is quantized
whole when it is full, so a KIVI key group is exactly one block of one head. Blocks are read
back through a block table and restored to the model's dtype for attention.

Storage for `num_blocks` blocks (P = packed code width, k = metadata per token):
    codes:       keys, values [num_blocks, num_kv_heads, block_size, P] uint8
    token meta:  name -> [num_blocks, num_kv_heads, block_size, k] float16 (per-token codecs)
    group meta:  name -> [num_blocks, num_kv_heads, head_dim] float16 (KIVI keys: one group per block and head)
"""

from __future__ import annotations

import torch

from kvwise.kv.codec import Codec, Encoded
from kvwise.kv.quantizer import Quantizer


class _CodecPool:
    """One role's (keys' or values') quantized blocks."""

    def __init__(self, codec: Codec, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device):
        codec.check_head_dim(head_dim)
        self.codec, self.block_size, self.num_kv_heads = codec, block_size, num_kv_heads
        probe = codec.encode(torch.zeros(block_size, head_dim, device=device), self._sizes(1, device))
        self.per_token = {
            name: tensor.new_zeros((num_blocks, num_kv_heads, *tensor.shape))
            for name, tensor in probe.per_token.items()
        }
        self.per_group = {
            name: tensor.new_zeros((num_blocks, num_kv_heads, *tensor.shape[1:]))
            for name, tensor in probe.per_group.items()
        }

    def _sizes(self, num_groups: int, device) -> torch.Tensor:
        return torch.full((num_groups,), self.block_size, dtype=torch.int16, device=device)

    def write(self, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
        """rows: [n, num_kv_heads, block_size, head_dim] for the blocks `block_ids` [n]."""
        n = block_ids.shape[0]
        encoded = self.codec.encode(rows.reshape(-1, rows.shape[-1]), self._sizes(n * self.num_kv_heads, rows.device))
        for name, pool in self.per_token.items():
            pool[block_ids] = encoded.per_token[name].view(n, self.num_kv_heads, self.block_size, -1)
        for name, pool in self.per_group.items():
            pool[block_ids] = encoded.per_group[name].view(n, self.num_kv_heads, -1)

    def read(self, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """-> [n, num_kv_heads, block_size, head_dim] restored rows."""
        n = block_ids.shape[0]
        per_token = {
            name: pool[block_ids].reshape(n * self.num_kv_heads * self.block_size, -1)
            for name, pool in self.per_token.items()
        }
        per_group = {name: pool[block_ids].reshape(n * self.num_kv_heads, -1) for name, pool in self.per_group.items()}
        sizes = self._sizes(n * self.num_kv_heads, block_ids.device) if per_group else None
        rows = self.codec.decode(Encoded(per_token, per_group, sizes), dtype)
        return rows.view(n, self.num_kv_heads, self.block_size, -1)

    def zero(self, block_ids: torch.Tensor) -> None:
        for pool in (*self.per_token.values(), *self.per_group.values()):
            pool[block_ids] = 0

    def nbytes(self) -> int:
        return sum(pool.nbytes for pool in (*self.per_token.values(), *self.per_group.values()))


class QuantizedBlocks:
    """A pool of quantized KV blocks for one layer.

    Args:
        quantizer: how keys and values are stored (its residual window is the engine's open,
            not-yet-full block, which stays in the model's dtype outside this pool).
        num_blocks, block_size, num_kv_heads, head_dim: the pool's geometry.
    """

    def __init__(
        self, quantizer: Quantizer, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device="cpu"
    ):
        if block_size < 1 or num_blocks < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.quantizer, self.block_size = quantizer, block_size
        self.keys = _CodecPool(quantizer.key_codec, num_blocks, block_size, num_kv_heads, head_dim, device)
        self.values = _CodecPool(quantizer.value_codec, num_blocks, block_size, num_kv_heads, head_dim, device)

    def write(self, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize full blocks. keys, values: [n, block_size, num_kv_heads, head_dim]; block_ids: [n]."""
        if keys.shape[1] != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {keys.shape[1]}")
        self.keys.write(block_ids, keys.transpose(1, 2))
        self.values.write(block_ids, values.transpose(1, 2))

    def read(self, block_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Restore blocks: keys, values [n, block_size, num_kv_heads, head_dim] in `dtype`."""
        return self.keys.read(block_ids, dtype).transpose(1, 2), self.values.read(block_ids, dtype).transpose(1, 2)

    def zero(self, block_ids: torch.Tensor) -> None:
        """Overwrite freed blocks with zeros, so the next owner cannot read the previous one's KV."""
        self.keys.zero(block_ids)
        self.values.zero(block_ids)

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes()
