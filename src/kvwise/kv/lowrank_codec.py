"""The low-rank codec: each row held as its first `rank` coordinates in its head's basis.

    coefficients c = (x - mean[h]) @ basis[h]     [num_tokens, rank]
    restored     x' = c @ basis[h]^T + mean[h]     [num_tokens, head_dim]

The coefficients are then stored by an inner codec (KIVI, INT8, ... or 16-bit floats), so
`lowrank:r=16+kivi4` holds a key in 16 x 4 bits instead of 64 x 4. The bases come from
`kvwise calibrate` (`kv.lowrank_basis`); a codec made from a name has none until a cache for a
model attaches them.
"""

from __future__ import annotations

import torch

from kvwise.kv.codec import Codec, Encoded


class LowRankCodec(Codec):
    """Encoded: the inner codec's, over `rank` channels.

    mean: [num_bases, head_dim]; basis: [num_bases, head_dim, rank] (orthonormal columns); a
    row's base is the `heads` index the store passes. `starts`: the first base of each layer, while
    the codec spans every layer (see `for_layer`)."""

    def __init__(self, rank: int, inner: Codec, mean=None, basis=None, starts: tuple[int, ...] | None = None):
        if rank < 1:
            raise ValueError(f"the rank r must be >= 1, got {rank}")
        self.rank, self.inner = rank, inner
        self.mean, self.basis, self.starts = mean, basis, starts
        self.bits, self.groups_tokens, self.needs_heads = inner.bits, inner.groups_tokens, True
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def attached(self) -> bool:
        return self.basis is not None

    def attach(self, mean: torch.Tensor, basis: torch.Tensor, starts: tuple[int, ...]) -> LowRankCodec:
        """This codec with every layer's bases (`LowRankBasis.flat`)."""
        return LowRankCodec(self.rank, self.inner, mean, basis, starts)

    def for_layer(self, layer_idx: int) -> LowRankCodec:
        """This codec with layer `layer_idx`'s bases only: `heads` are then the layer's KV heads."""
        if not self.attached or self.starts is None:
            return self
        if not 0 <= layer_idx < len(self.starts):
            raise ValueError(f"the low-rank basis has {len(self.starts)} layers, not a layer {layer_idx}")
        end = self.starts[layer_idx + 1] if layer_idx + 1 < len(self.starts) else self.mean.shape[0]
        start = self.starts[layer_idx]
        return LowRankCodec(self.rank, self.inner, self.mean[start:end], self.basis[start:end])

    def check_head_dim(self, head_dim: int) -> None:
        if self.attached and self.basis.shape[1] != head_dim:
            raise ValueError(f"the low-rank basis is for head_dim {self.basis.shape[1]}, the model's is {head_dim}")
        self.inner.check_head_dim(self.rank)

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.attached:
            raise ValueError(
                "the lowrank quantizer has no basis: use it through a cache built for the model "
                "(KVWiseCache(model, quant='lowrank:r=16+kivi4'), or the engine), which attaches "
                "the model's bases from `kvwise calibrate`"
            )
        if device not in self._on_device:
            self._on_device[device] = (self.mean.to(device), self.basis.to(device))
        return self._on_device[device]

    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        raise ValueError("the low-rank codec projects each row on its own head's basis: call encode_heads")

    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        raise ValueError("the low-rank codec restores each row with its own head's basis: call decode_heads")

    def encode_heads(self, rows: torch.Tensor, group_sizes: torch.Tensor | None, heads: torch.Tensor) -> Encoded:
        mean, basis = self._tables(rows.device)
        coefficients = rows.new_empty((rows.shape[0], self.rank), dtype=torch.float32)
        for head in heads.unique().tolist():  # a few heads; one matmul each
            of_head = heads == head
            coefficients[of_head] = (rows[of_head].float() - mean[head]) @ basis[head]
        return self.inner.encode(coefficients, group_sizes)

    def decode_heads(self, encoded: Encoded, dtype: torch.dtype, heads: torch.Tensor) -> torch.Tensor:
        mean, basis = self._tables(heads.device)
        coefficients = self.inner.decode(encoded, torch.float32)
        rows = coefficients.new_empty((coefficients.shape[0], basis.shape[1]))
        for head in heads.unique().tolist():
            of_head = heads == head
            rows[of_head] = coefficients[of_head] @ basis[head].T + mean[head]
        return rows.to(dtype)
