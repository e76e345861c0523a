"""`KVStore`: one layer's keys and values, per (batch entry, KV head), optionally quantized.

Each head holds its tokens oldest first: a quantized part, then a full-precision residual window.

    residual_keys, residual_values: [num_residual_rows, head_dim] in the model's dtype
    quantized_keys, quantized_values: `Encoded` rows, [num_quantized_rows, ...]
    residual_lengths, quantized_lengths: [batch, num_kv_heads] int64

Without a quantizer everything stays in the residual part: the store is then the plain
variable-length cache of kvwise. With one, tokens leave the residual window `group_size` at a
time once it holds `residual_length + group_size` of them, and `flush()` quantizes all of it.
Quantized rows are only ever copied or dropped, never quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.kv import ragged
from kvwise.kv.codec import Encoded, append_by_head
from kvwise.kv.quantizer import Quantizer


@dataclass
class Spill:
    """What one commit quantized, for the attention-error probe.

    slots: [batch, num_kv_heads, slots] bool over the committed step's padded layout.
    keys, values: [slots.sum(), head_dim] the restored (dequantized) rows, in slot order.
    """

    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class ErrorTally:
    """Running squared error and squared norm of everything quantized, for relative errors."""

    key_error: float = 0.0
    key_norm: float = 0.0
    value_error: float = 0.0
    value_norm: float = 0.0

    def add(self, keys, restored_keys, values, restored_values) -> None:
        self.key_error += float((keys.float() - restored_keys.float()).pow(2).sum())
        self.key_norm += float(keys.float().pow(2).sum())
        self.value_error += float((values.float() - restored_values.float()).pow(2).sum())
        self.value_norm += float(values.float().pow(2).sum())

    def relative(self) -> tuple[float | None, float | None]:
        if self.key_norm == 0:
            return None, None
        return (self.key_error / self.key_norm) ** 0.5, (self.value_error / max(self.value_norm, 1e-30)) ** 0.5


class KVStore:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, quantizer: Quantizer | None):
        """An empty store shaped after a first step's keys and values [batch, num_kv_heads, len, head_dim]."""
        batch, num_kv_heads, _, head_dim = keys.shape
        if quantizer is not None:
            quantizer.check_head_dim(head_dim)
        self.quantizer = quantizer
        self.grid = (batch, num_kv_heads)
        self.dtype, self.device = keys.dtype, keys.device
        self.residual_keys = keys.new_empty((0, head_dim))
        self.residual_values = values.new_empty((0, values.shape[-1]))
        self.residual_lengths = torch.zeros(self.grid, dtype=torch.int64, device=self.device)
        self.quantized_lengths = torch.zeros_like(self.residual_lengths)
        self.key_groups = torch.zeros_like(self.residual_lengths)  # groups per head (token-grouping codecs)
        self.value_groups = torch.zeros_like(self.residual_lengths)
        self.quantized_keys: Encoded | None = None
        self.quantized_values: Encoded | None = None
        self.errors = ErrorTally()
        self.quantize_calls = 0  # rows handed to a codec, counted so tests can prove nothing is re-quantized

    # ---- reading -----------------------------------------------------------------------------
    @property
    def lengths(self) -> torch.Tensor:
        """[batch, num_kv_heads] int64: tokens held per head."""
        return self.quantized_lengths + self.residual_lengths

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [batch, num_kv_heads, max_len, head_dim] (quantized rows restored) and
        valid [batch, num_kv_heads, max_len]. Per head: quantized tokens, then residual ones."""
        lengths = self.lengths
        width = int(lengths.max()) if lengths.numel() else 0
        valid = torch.arange(width, device=self.device) < lengths[..., None]
        if self.quantized_keys is None or self.quantized_keys.num_tokens == 0:
            keys = ragged.pad(self.residual_keys, self.residual_lengths.flatten(), self.grid, width)
            values = ragged.pad(self.residual_values, self.residual_lengths.flatten(), self.grid, width)
            return keys, values, valid
        counts_q, counts_r = self.quantized_lengths.flatten(), self.residual_lengths.flatten()
        restored_keys = self.quantizer.key_codec.decode(self.quantized_keys, self.dtype)
        restored_values = self.quantizer.value_codec.decode(self.quantized_values, self.dtype)
        keys = ragged.interleave(restored_keys, counts_q, self.residual_keys, counts_r)
        values = ragged.interleave(restored_values, counts_q, self.residual_values, counts_r)
        keys = ragged.pad(keys, lengths.flatten(), self.grid, width)
        values = ragged.pad(values, lengths.flatten(), self.grid, width)
        return keys, values, valid

    def nbytes(self) -> int:
        """Bytes really held: residual rows, codes, scales, minimums, group sizes and lengths."""
        total = self.residual_keys.nbytes + self.residual_values.nbytes
        total += self.residual_lengths.nbytes + self.quantized_lengths.nbytes
        if self.quantizer is not None:
            total += self.key_groups.nbytes + self.value_groups.nbytes
        for encoded in (self.quantized_keys, self.quantized_values):
            if encoded is not None:
                total += encoded.nbytes()
        return total

    # ---- writing -----------------------------------------------------------------------------
    def commit(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, spill: bool = True) -> Spill | None:
        """Store the kept slots of a step's padded layout.

        Args:
            keys, values: [batch, num_kv_heads, slots, head_dim]: this store's `padded()` rows
                first (quantized, then residual), then any new tokens.
            keep: [batch, num_kv_heads, slots] bool.
            spill: False to keep every new token at full precision for now (a context that is
                still being compressed: eviction first, then quantization).
        Returns:
            what got quantized, if anything.
        """
        quantized_slots = torch.arange(keep.shape[-1], device=self.device) < self.quantized_lengths[..., None]
        if self.quantized_keys is not None:
            kept_quantized = keep[quantized_slots]  # flat, in storage order
            if not bool(kept_quantized.all()):
                self._drop_quantized(kept_quantized)
        self.quantized_lengths = (keep & quantized_slots).sum(dim=-1)
        residual_slots = keep & ~quantized_slots
        self.residual_keys = keys[residual_slots]
        self.residual_values = values[residual_slots]
        self.residual_lengths = residual_slots.sum(dim=-1)
        return self._spill(residual_slots, flush=False) if spill else None

    def flush(self) -> Spill | None:
        """Quantize the whole residual window (a frozen context needs no full-precision tail).

        The returned `Spill` refers to the layout `padded()` had before the flush."""
        if self.quantizer is None:
            return None
        lengths = self.lengths
        slots = torch.arange(int(lengths.max()) if lengths.numel() else 0, device=self.device)
        residual_slots = (slots < lengths[..., None]) & (slots >= self.quantized_lengths[..., None])
        return self._spill(residual_slots, flush=True)

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep the batch entries `indices` [new_batch] (repeats allowed), in that order."""
        num_kv_heads = self.grid[1]
        heads = (
            indices.to(self.device)[:, None] * num_kv_heads + torch.arange(num_kv_heads, device=self.device)
        ).flatten()
        grid = (int(indices.shape[0]), num_kv_heads)
        counts_r = self.residual_lengths.flatten()
        self.residual_keys, _ = ragged.gather_heads(self.residual_keys, counts_r, heads)
        self.residual_values, _ = ragged.gather_heads(self.residual_values, counts_r, heads)
        if self.quantized_keys is not None:
            counts_q = self.quantized_lengths.flatten()
            self.quantized_keys = self.quantized_keys.gather_heads(counts_q, self.key_groups.flatten(), heads)
            self.quantized_values = self.quantized_values.gather_heads(counts_q, self.value_groups.flatten(), heads)
        for name in ("residual_lengths", "quantized_lengths", "key_groups", "value_groups"):
            setattr(self, name, getattr(self, name).flatten()[heads].view(grid))
        self.grid = grid

    # ---- quantization ------------------------------------------------------------------------
    def _drop_quantized(self, kept: torch.Tensor) -> None:
        counts_heads = self.key_groups.flatten()
        self.quantized_keys, key_groups = self.quantized_keys.select(kept, counts_heads)
        self.quantized_values, value_groups = self.quantized_values.select(kept, self.value_groups.flatten())
        self.key_groups, self.value_groups = key_groups.view(self.grid), value_groups.view(self.grid)

    def _spill(self, residual_slots: torch.Tensor, flush: bool) -> Spill | None:
        """Move the oldest residual tokens into the quantized part, whole groups at a time."""
        quantizer = self.quantizer
        if quantizer is None:
            return None
        window, group = quantizer.residual_length, quantizer.group_size
        lengths = self.residual_lengths
        if flush:
            moving = lengths
        else:
            moving = torch.where(lengths >= window + group, (lengths - window) // group * group, 0)
        if int(moving.sum()) == 0:
            return None
        counts_r, counts_m = lengths.flatten(), moving.flatten()
        leaving = ragged.first_rows_mask(counts_r, counts_m)
        keys, values = self.residual_keys[leaving], self.residual_values[leaving]
        groups_per_head = (counts_m + group - 1) // group
        group_sizes = self._group_sizes(counts_m, groups_per_head, group)
        new_keys = quantizer.key_codec.encode(keys, group_sizes)
        new_values = quantizer.value_codec.encode(values, group_sizes)
        self.quantize_calls += 2 * keys.shape[0]
        new_key_groups = groups_per_head if quantizer.key_codec.groups_tokens else torch.zeros_like(counts_m)
        new_value_groups = groups_per_head if quantizer.value_codec.groups_tokens else torch.zeros_like(counts_m)
        counts_q = self.quantized_lengths.flatten()
        self.quantized_keys = append_by_head(
            self.quantized_keys, counts_q, self.key_groups.flatten(), new_keys, counts_m, new_key_groups
        )
        self.quantized_values = append_by_head(
            self.quantized_values, counts_q, self.value_groups.flatten(), new_values, counts_m, new_value_groups
        )
        self.key_groups = self.key_groups + new_key_groups.view(self.grid)
        self.value_groups = self.value_groups + new_value_groups.view(self.grid)
        self.quantized_lengths = self.quantized_lengths + moving
        self.residual_keys, self.residual_values = self.residual_keys[~leaving], self.residual_values[~leaving]
        self.residual_lengths = lengths - moving
        restored_keys = quantizer.key_codec.decode(new_keys, self.dtype)
        restored_values = quantizer.value_codec.decode(new_values, self.dtype)
        self.errors.add(keys, restored_keys, values, restored_values)
        rank = torch.cumsum(residual_slots, dim=-1) - 1
        slots = residual_slots & (rank < moving[..., None])
        return Spill(slots, restored_keys, restored_values)

    @staticmethod
    def _group_sizes(tokens_per_head: torch.Tensor, groups_per_head: torch.Tensor, group: int) -> torch.Tensor:
        """[sum(groups_per_head)] int64: `group` tokens per group, the last group of a head holding the rest."""
        sizes = torch.full((int(groups_per_head.sum()),), group, dtype=torch.int64, device=tokens_per_head.device)
        has_groups = groups_per_head > 0
        last = (torch.cumsum(groups_per_head, dim=0) - 1)[has_groups]
        sizes[last] = (tokens_per_head - group * (groups_per_head - 1))[has_groups]
        return sizes
