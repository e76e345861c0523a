"""`KVStore`: one layer's keys and values, per (batch entry, KV head), optionally quantized.

Each head holds its tokens oldest first, in three parts: a few attention-sink tokens at full
precision, the quantized part, then a full-precision residual window of the newest tokens.

    sink_keys, sink_values:         [num_sink_rows, head_dim] in the model's dtype
    quantized_keys, quantized_values: `Encoded` rows, [num_quantized_rows, ...]
    residual_keys, residual_values: [num_residual_rows, head_dim] in the model's dtype
    sink_lengths, quantized_lengths, residual_lengths: [batch, num_kv_heads] int64

The three parts are the mix's `StoredForm`, which the engine's quantized pages follow too.
Without a quantizer everything stays in the residual part: the store is then the plain
variable-length cache of kvwise. With one, tokens leave the residual window `group_size` at a
time once it holds `residual_length + group_size` of them, and `flush()` moves all of it. The
first `sink_tokens` tokens to leave a head become its sinks; the rest are quantized. Quantized
rows are only ever copied or dropped, never quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwise.kv import ragged
from kvwise.kv.codec import Encoded, append_by_head, concat_encoded
from kvwise.kv.quantizer import Quantizer
from kvwise.kv.stored_form import StoredForm


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


MAX_CHUNKS = 64  # merging is O(quantized tokens); decoding reads all chunks in one pass anyway


@dataclass
class QuantizedChunk:
    """Quantized rows of every head, per head in storage order.

    tokens, key_groups, value_groups: [num_heads] int64 rows and groups per head.
    """

    keys: Encoded
    values: Encoded
    tokens: torch.Tensor
    key_groups: torch.Tensor
    value_groups: torch.Tensor

    def append(self, later: QuantizedChunk) -> QuantizedChunk:
        """Per head, this chunk's rows followed by `later`'s."""
        keys = append_by_head(self.keys, self.tokens, self.key_groups, later.keys, later.tokens, later.key_groups)
        values = append_by_head(
            self.values, self.tokens, self.value_groups, later.values, later.tokens, later.value_groups
        )
        return QuantizedChunk(
            keys,
            values,
            self.tokens + later.tokens,
            self.key_groups + later.key_groups,
            self.value_groups + later.value_groups,
        )

    def select(self, keep: torch.Tensor) -> QuantizedChunk:
        """Drop rows; `keep` [num_rows] bool. Codes are copied, never re-quantized."""
        keys, key_groups = self.keys.select(keep, self.key_groups)
        values, value_groups = self.values.select(keep, self.value_groups)
        tokens = torch.bincount(ragged.head_of_rows(self.tokens)[keep], minlength=self.tokens.numel())
        return QuantizedChunk(keys, values, tokens, key_groups, value_groups)

    def gather_heads(self, heads: torch.Tensor) -> QuantizedChunk:
        return QuantizedChunk(
            self.keys.gather_heads(self.tokens, self.key_groups, heads),
            self.values.gather_heads(self.tokens, self.value_groups, heads),
            self.tokens[heads],
            self.key_groups[heads],
            self.value_groups[heads],
        )


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
        self.sink_keys, self.sink_values = self.residual_keys, self.residual_values
        self.sink_lengths = torch.zeros_like(self.residual_lengths)
        self.key_groups = torch.zeros_like(self.residual_lengths)  # groups per head (token-grouping codecs)
        self.value_groups = torch.zeros_like(self.residual_lengths)
        # The quantized part: a consolidated base plus chunks appended since, so that adding
        # tokens costs O(new tokens); chunks merge into the base every MAX_CHUNKS appends.
        self._base: QuantizedChunk | None = None
        self._chunks: list[QuantizedChunk] = []
        self.errors = ErrorTally()
        self.quantize_calls = 0  # rows handed to a codec, counted so tests can prove nothing is re-quantized

    # ---- reading -----------------------------------------------------------------------------
    @property
    def quantized_keys(self) -> Encoded | None:
        """All quantized key rows, in storage order."""
        self._consolidate()
        return None if self._base is None else self._base.keys

    @property
    def quantized_values(self) -> Encoded | None:
        self._consolidate()
        return None if self._base is None else self._base.values

    def _quantized_parts(self) -> list[QuantizedChunk]:
        return ([] if self._base is None else [self._base]) + self._chunks

    def consolidated_base(self) -> QuantizedChunk | None:
        """Every quantized chunk merged into one (None: nothing quantized yet), for saving."""
        self._consolidate()
        return self._base

    def set_base(self, base: QuantizedChunk | None) -> None:
        """Restore the quantized part saved with `consolidated_base` (before any chunk is appended)."""
        self._base = base

    def _consolidate(self) -> None:
        """Merge the appended chunks into the base (an O(quantized tokens) copy)."""
        for chunk in self._chunks:
            self._base = chunk if self._base is None else self._base.append(chunk)
        self._chunks = []

    @property
    def lengths(self) -> torch.Tensor:
        """[batch, num_kv_heads] int64: tokens held per head."""
        return self.sink_lengths + self.quantized_lengths + self.residual_lengths

    def _segment_slots(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """sink and quantized slot masks [batch, num_kv_heads, width] of the padded layout."""
        slots = torch.arange(width, device=self.device)
        sink_end = self.sink_lengths[..., None]
        return slots < sink_end, (slots >= sink_end) & (slots < sink_end + self.quantized_lengths[..., None])

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [batch, num_kv_heads, max_len, head_dim] (quantized rows restored) and
        valid [batch, num_kv_heads, max_len]. Per head: sinks, quantized tokens, residual ones."""
        lengths = self.lengths
        width = int(lengths.max()) if lengths.numel() else 0
        valid = torch.arange(width, device=self.device) < lengths[..., None]
        parts = self._quantized_parts()
        if not parts and not bool(self.sink_lengths.any()):
            keys = ragged.pad(self.residual_keys, self.residual_lengths.flatten(), self.grid, width)
            values = ragged.pad(self.residual_values, self.residual_lengths.flatten(), self.grid, width)
            return keys, values, valid
        counts = [self.sink_lengths.flatten(), *(part.tokens for part in parts), self.residual_lengths.flatten()]
        sizes = [part.keys.num_tokens for part in parts]
        # One decode over every chunk, then per-chunk views: the op count stays flat as chunks grow.
        quantizer = self.quantizer
        heads = torch.cat([self._kv_head_of_rows(part.tokens) for part in parts]) if quantizer.needs_heads else None
        key_parts = quantizer.key_codec.decode_heads(concat_encoded([p.keys for p in parts]), self.dtype, heads)
        value_parts = quantizer.value_codec.decode_heads(concat_encoded([p.values for p in parts]), self.dtype, heads)
        key_parts, value_parts = key_parts.split(sizes), value_parts.split(sizes)
        keys = ragged.pad_parts([self.sink_keys, *key_parts, self.residual_keys], counts, self.grid, width)
        values = ragged.pad_parts([self.sink_values, *value_parts, self.residual_values], counts, self.grid, width)
        return keys, values, valid

    def nbytes(self) -> int:
        """Bytes really held: full-precision rows, codes, scales, minimums, group sizes and lengths."""
        total = self.residual_keys.nbytes + self.residual_values.nbytes
        total += self.residual_lengths.nbytes + self.quantized_lengths.nbytes
        if self.quantizer is not None:
            total += self.sink_keys.nbytes + self.sink_values.nbytes + self.sink_lengths.nbytes
            total += self.key_groups.nbytes + self.value_groups.nbytes
        for part in self._quantized_parts():
            total += part.keys.nbytes() + part.values.nbytes() + part.tokens.nbytes
            total += part.key_groups.nbytes + part.value_groups.nbytes
        return total

    # ---- writing -----------------------------------------------------------------------------
    def commit(self, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, spill: bool = True) -> Spill | None:
        """Store the kept slots of a step's padded layout.

        Args:
            keys, values: [batch, num_kv_heads, slots, head_dim]: this store's `padded()` rows
                first (sinks, quantized, residual), then any new tokens.
            keep: [batch, num_kv_heads, slots] bool.
            spill: False to keep every new token at full precision for now (a context that is
                still being compressed: eviction first, then quantization).
        Returns:
            what got quantized, if anything.
        """
        sink_slots, quantized_slots = self._segment_slots(keep.shape[-1])
        if self._quantized_parts():
            kept_quantized = keep[quantized_slots]  # flat, in storage order
            if not bool(kept_quantized.all()):
                self._drop_quantized(kept_quantized)
        self.quantized_lengths = (keep & quantized_slots).sum(dim=-1)
        if self.quantizer is not None:
            kept_sinks = keep & sink_slots
            self.sink_keys, self.sink_values = keys[kept_sinks], values[kept_sinks]
            self.sink_lengths = kept_sinks.sum(dim=-1)
        residual_slots = keep & ~quantized_slots & ~sink_slots
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
        first_residual = (self.sink_lengths + self.quantized_lengths)[..., None]
        residual_slots = (slots < lengths[..., None]) & (slots >= first_residual)
        return self._spill(residual_slots, flush=True)

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep the batch entries `indices` [new_batch] (repeats allowed), in that order."""
        num_kv_heads = self.grid[1]
        heads = ragged.heads_of_batch(indices.to(self.device), num_kv_heads)
        grid = (int(indices.shape[0]), num_kv_heads)
        counts_r, counts_s = self.residual_lengths.flatten(), self.sink_lengths.flatten()
        self.residual_keys, _ = ragged.gather_heads(self.residual_keys, counts_r, heads)
        self.residual_values, _ = ragged.gather_heads(self.residual_values, counts_r, heads)
        self.sink_keys, _ = ragged.gather_heads(self.sink_keys, counts_s, heads)
        self.sink_values, _ = ragged.gather_heads(self.sink_values, counts_s, heads)
        self._consolidate()
        if self._base is not None:
            self._base = self._base.gather_heads(heads)
        for name in ("residual_lengths", "quantized_lengths", "sink_lengths", "key_groups", "value_groups"):
            setattr(self, name, getattr(self, name).flatten()[heads].view(grid))
        self.grid = grid

    # ---- quantization ------------------------------------------------------------------------
    def _drop_quantized(self, kept: torch.Tensor) -> None:
        self._consolidate()
        self._base = self._base.select(kept)
        self.key_groups, self.value_groups = (
            self._base.key_groups.view(self.grid),
            self._base.value_groups.view(self.grid),
        )

    def _spill(self, residual_slots: torch.Tensor, flush: bool) -> Spill | None:
        """Move the oldest residual tokens out, whole groups at a time: to the sinks while a head
        has fewer than `sink_tokens` and nothing quantized, then into the quantized part."""
        quantizer = self.quantizer
        if quantizer is None:
            return None
        lengths = self.residual_lengths
        moving = lengths if flush else StoredForm.of(quantizer).settling(lengths)
        if int(moving.sum()) == 0:
            return None
        open_sinks = torch.where(self.quantized_lengths == 0, quantizer.sink_tokens - self.sink_lengths, 0)
        to_sinks = torch.minimum(open_sinks.clamp(min=0), moving)
        counts_r, counts_m, counts_s = lengths.flatten(), moving.flatten(), to_sinks.flatten()
        rank = ragged.rank_in_head(counts_r)
        heads = ragged.head_of_rows(counts_r)
        sinking, leaving = rank < counts_s[heads], rank < counts_m[heads]
        quantizing = leaving & ~sinking
        if bool(sinking.any()):
            self._append_sinks(self.residual_keys[sinking], self.residual_values[sinking], counts_s)
        counts_q = counts_m - counts_s
        if int(counts_q.sum()) > 0:
            keys, values = self.residual_keys[quantizing], self.residual_values[quantizing]
            restored_keys, restored_values = self._quantize(keys, values, counts_q)
        self.residual_keys, self.residual_values = self.residual_keys[~leaving], self.residual_values[~leaving]
        self.residual_lengths = lengths - moving
        if int(counts_q.sum()) == 0:
            return None
        slot_rank = torch.cumsum(residual_slots, dim=-1) - 1
        slots = residual_slots & (slot_rank >= to_sinks[..., None]) & (slot_rank < moving[..., None])
        return Spill(slots, restored_keys, restored_values)

    def _append_sinks(self, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor) -> None:
        current = self.sink_lengths.flatten()
        self.sink_keys = ragged.interleave(self.sink_keys, current, keys, counts)
        self.sink_values = ragged.interleave(self.sink_values, current, values, counts)
        self.sink_lengths = self.sink_lengths + counts.view(self.grid)

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor):
        """Quantize `counts[h]` rows per head and append them; returns the restored rows."""
        quantizer, group = self.quantizer, self.quantizer.group_size
        groups_per_head = (counts + group - 1) // group
        group_sizes = self._group_sizes(counts, groups_per_head, group)
        heads = self._kv_head_of_rows(counts) if quantizer.needs_heads else None
        new_keys = quantizer.key_codec.encode_heads(keys, group_sizes, heads)
        new_values = quantizer.value_codec.encode_heads(values, group_sizes, heads)
        self.quantize_calls += 2 * keys.shape[0]
        new_key_groups = groups_per_head if quantizer.key_codec.groups_tokens else torch.zeros_like(counts)
        new_value_groups = groups_per_head if quantizer.value_codec.groups_tokens else torch.zeros_like(counts)
        self._chunks.append(QuantizedChunk(new_keys, new_values, counts, new_key_groups, new_value_groups))
        if len(self._chunks) >= MAX_CHUNKS:
            self._consolidate()
        self.key_groups = self.key_groups + new_key_groups.view(self.grid)
        self.value_groups = self.value_groups + new_value_groups.view(self.grid)
        self.quantized_lengths = self.quantized_lengths + counts.view(self.grid)
        restored_keys = quantizer.key_codec.decode_heads(new_keys, self.dtype, heads)
        restored_values = quantizer.value_codec.decode_heads(new_values, self.dtype, heads)
        self.errors.add(keys, restored_keys, values, restored_values)
        return restored_keys, restored_values

    def _kv_head_of_rows(self, counts: torch.Tensor) -> torch.Tensor:
        """[sum(counts)] int64: the KV head of each row, for rows counted per (batch entry, head)."""
        return ragged.head_of_rows(counts) % self.grid[1]

    @staticmethod
    def _group_sizes(tokens_per_head: torch.Tensor, groups_per_head: torch.Tensor, group: int) -> torch.Tensor:
        """[sum(groups_per_head)] int64: `group` tokens per group, the last group of a head holding the rest."""
        sizes = torch.full((int(groups_per_head.sum()),), group, dtype=torch.int64, device=tokens_per_head.device)
        has_groups = groups_per_head > 0
        last = (torch.cumsum(groups_per_head, dim=0) - 1)[has_groups]
        sizes[last] = (tokens_per_head - group * (groups_per_head - 1))[has_groups]
        return sizes
