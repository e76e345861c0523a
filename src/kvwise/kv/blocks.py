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


class CodecPool:
    """One role's (keys' or values') quantized blocks."""

    def __init__(self, codec: Codec, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device):
        codec.check_head_dim(head_dim)
        self.codec, self.block_size, self.num_kv_heads = codec, block_size, num_kv_heads
        heads = torch.zeros(block_size, dtype=torch.int64, device=device) if codec.needs_heads else None
        probe = codec.encode_heads(torch.zeros(block_size, head_dim, device=device), self._sizes(1, device), heads)
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

    def _heads(self, bases: torch.Tensor | None, n: int, device) -> torch.Tensor | None:
        """[n * num_kv_heads * block_size] int64: each row's head (or the `bases` [n, num_kv_heads]
        given); None for codecs that do not ask (the read path of every decode step)."""
        if not self.codec.needs_heads:
            return None
        if bases is None:
            bases = torch.arange(self.num_kv_heads, device=device).expand(n, -1)
        return bases.reshape(-1).repeat_interleave(self.block_size)

    def write(self, block_ids: torch.Tensor, rows: torch.Tensor, bases: torch.Tensor | None = None) -> None:
        """rows: [n, num_kv_heads, block_size, head_dim] for the blocks `block_ids` [n]. `bases`:
        [n, num_kv_heads] the head index a per-head codec uses, when it is not the head's own."""
        n = block_ids.shape[0]
        sizes = self._sizes(n * self.num_kv_heads, rows.device)
        heads = self._heads(bases, n, rows.device)
        encoded = self.codec.encode_heads(rows.reshape(-1, rows.shape[-1]), sizes, heads)
        for name, pool in self.per_token.items():
            pool[block_ids] = encoded.per_token[name].view(n, self.num_kv_heads, self.block_size, -1)
        for name, pool in self.per_group.items():
            pool[block_ids] = encoded.per_group[name].view(n, self.num_kv_heads, -1)

    def read(self, block_ids: torch.Tensor, dtype: torch.dtype, bases: torch.Tensor | None = None) -> torch.Tensor:
        """-> [n, num_kv_heads, block_size, head_dim] restored rows (`bases` as for `write`)."""
        n = block_ids.shape[0]
        per_token = {
            name: pool[block_ids].reshape(n * self.num_kv_heads * self.block_size, -1)
            for name, pool in self.per_token.items()
        }
        per_group = {name: pool[block_ids].reshape(n * self.num_kv_heads, -1) for name, pool in self.per_group.items()}
        sizes = self._sizes(n * self.num_kv_heads, block_ids.device) if per_group else None
        rows = self.codec.decode_heads(
            Encoded(per_token, per_group, sizes), dtype, self._heads(bases, n, block_ids.device)
        )
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
        self.keys = CodecPool(quantizer.key_codec, num_blocks, block_size, num_kv_heads, head_dim, device)
        self.values = CodecPool(quantizer.value_codec, num_blocks, block_size, num_kv_heads, head_dim, device)

    def write(self, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bases=None) -> None:
        """Quantize full blocks. keys, values: [n, block_size, num_kv_heads, head_dim]; block_ids: [n];
        bases: [n, num_kv_heads] for a per-head codec, when a block's heads are not the layer's own
        (a pool of single-head pages from every layer)."""
        if keys.shape[1] != self.block_size:
            raise ValueError(f"a block holds {self.block_size} tokens, got {keys.shape[1]}")
        self.keys.write(block_ids, keys.transpose(1, 2), bases)
        self.values.write(block_ids, values.transpose(1, 2), bases)

    def read(self, block_ids: torch.Tensor, dtype: torch.dtype, bases=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Restore blocks: keys, values [n, block_size, num_kv_heads, head_dim] in `dtype`."""
        keys, values = self.keys.read(block_ids, dtype, bases), self.values.read(block_ids, dtype, bases)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def zero(self, block_ids: torch.Tensor) -> None:
        """Overwrite freed blocks with zeros, so the next owner cannot read the previous one's KV."""
        self.keys.zero(block_ids)
        self.values.zero(block_ids)

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes()
