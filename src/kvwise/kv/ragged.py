"""Flat per-head ("ragged") tensors: rows of every head, head after head, with a count per head.

kvwise stores what each (batch entry, KV head) keeps as consecutive rows of one flat tensor, so
heads may hold different numbers of tokens and the memory really shrinks. These helpers move
such rows around without Python loops over heads.

Throughout, `counts` is a 1-D int64 tensor with one entry per head, in storage order.
"""

from __future__ import annotations

import torch


def starts_of(counts: torch.Tensor) -> torch.Tensor:
    """Row where each head begins: the exclusive cumulative sum of `counts`."""
    return torch.cumsum(counts, dim=0) - counts


def head_of_rows(counts: torch.Tensor) -> torch.Tensor:
    """[sum(counts)] int64: the head each row belongs to."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)


def rank_in_head(counts: torch.Tensor) -> torch.Tensor:
    """[sum(counts)] int64: each row's index within its head."""
    heads = head_of_rows(counts)
    return torch.arange(heads.numel(), device=counts.device) - starts_of(counts)[heads]


def interleave_plan(first_counts: torch.Tensor, second_counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination rows that put, per head, the rows of a first tensor before those of a second."""
    out_starts = starts_of(first_counts + second_counts)
    first_heads, second_heads = head_of_rows(first_counts), head_of_rows(second_counts)
    first_dest = out_starts[first_heads] + rank_in_head(first_counts)
    second_dest = out_starts[second_heads] + first_counts[second_heads] + rank_in_head(second_counts)
    return first_dest, second_dest


def apply_plan(first: torch.Tensor, second: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = first.new_empty((first.shape[0] + second.shape[0], *first.shape[1:]))
    out[plan[0]] = first
    out[plan[1]] = second
    return out


def interleave(first: torch.Tensor, first_counts: torch.Tensor, second: torch.Tensor, second_counts: torch.Tensor):
    """Per head, the rows of `first` followed by the rows of `second`.

    Args:
        first: [sum(first_counts), ...]; second: [sum(second_counts), ...] with the same trailing shape.
    Returns:
        [sum(first_counts) + sum(second_counts), ...]
    """
    if second.shape[0] == 0:
        return first
    if first.shape[0] == 0:
        return second
    return apply_plan(first, second, interleave_plan(first_counts, second_counts))


def gather_heads(flat: torch.Tensor, counts: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `heads` (indices into `counts`, repeats allowed), in that order.

    Returns:
        (rows [sum(counts[heads]), ...], new counts [len(heads)])
    """
    new_counts = counts[heads]
    sources = torch.repeat_interleave(starts_of(counts)[heads], new_counts) + rank_in_head(new_counts)
    return flat[sources], new_counts


def heads_of_batch(indices: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Head indices (in batch-major storage order) of the batch entries `indices` [new_batch]."""
    return (indices[:, None] * num_kv_heads + torch.arange(num_kv_heads, device=indices.device)).flatten()


def first_rows_mask(counts: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """[sum(counts)] bool: True for the first `take[h]` rows of each head h."""
    return rank_in_head(counts) < take[head_of_rows(counts)]


def pad(flat: torch.Tensor, counts: torch.Tensor, shape: tuple[int, ...], width: int | None = None) -> torch.Tensor:
    """Flat rows -> padded [*shape, width, ...] with zeros after each head's rows.

    `shape` is the head grid (for example (batch, num_kv_heads)); `counts` has prod(shape) entries.
    """
    max_len = int(counts.max()) if counts.numel() else 0
    width = max_len if width is None else width
    slot_valid = torch.arange(width, device=counts.device) < counts.view(*shape, 1)
    if int(counts.sum()) == slot_valid.numel():
        return flat.view(*shape, width, *flat.shape[1:])
    padded = flat.new_zeros((*shape, width, *flat.shape[1:]))
    padded[slot_valid] = flat
    return padded


def pad_parts(parts: list[torch.Tensor], part_counts: list[torch.Tensor], shape: tuple[int, ...], width: int):
    """Per head, the rows of each part in turn, written straight into a zero-padded layout.

    parts[i]: [sum(part_counts[i]), ...]; returns [*shape, width, ...] with zeros after each head's rows.
    """
    num_heads = part_counts[0].numel()
    reference = next(part for part in parts if part.shape[0] > 0) if any(p.shape[0] for p in parts) else parts[0]
    uniform = all(bool((counts == counts[0]).all()) for counts in part_counts if counts.numel())
    if uniform and sum(int(counts[0]) for counts in part_counts) == width:
        # Every head holds the same number of rows of each part (nothing evicted): no scatter needed.
        blocks = [part.view(num_heads, -1, *part.shape[1:]) for part in parts if part.shape[0]]
        return torch.cat(blocks, dim=1).view(*shape, width, *reference.shape[1:])
    padded = reference.new_zeros((num_heads, width, *reference.shape[1:]))
    offset = torch.zeros_like(part_counts[0])
    for part, counts in zip(parts, part_counts):
        if part.shape[0]:
            heads = head_of_rows(counts)
            padded[heads, offset[heads] + rank_in_head(counts)] = part
        offset = offset + counts
    return padded.view(*shape, width, *reference.shape[1:])
