"""Where a quantized region's kept rows go when a compaction rewrites it (`KVCacheManager._write_settled`).

The library's cache drops rows and never quantizes one twice (`KVStore`); the engine's region
follows it. Per (layer, KV head), each kept row is one of:

    in a page     the previous region held it quantized: it keeps its codes, in its page
    full          in the model's dtype: a sink, or in the residual window
    settling      in the model's dtype until now, leaving the residual window: quantized into a
                  new page (all but the sinks when the compaction freezes a context)

A page that keeps any row stays whole: KIVI keys share a scale per channel over the page's
tokens, so the codes of the rows it keeps stay valid only there. A cap evicts rows all over a
head's pages, though, so once its pages hold fewer than `MIN_PAGE_OCCUPANCY` of the rows they
could, the head's quantized rows are quantized again into dense pages: a cap bounds the bytes as
well as the tokens (a repack that would free no page is skipped). Per-token codes (int8, fp8,
KIVI values) come back nearly the same from a restored row, as its extremes set the scale again
(up to the scale's float16 rounding); KIVI keys take a new per-channel range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvwise.engine.head_region import HeadRegion
from kvwise.kv.stored_form import StoredForm, into_pages

# below this share of rows kept in a head's pages, they are repacked (quantized again, densely)
# when that frees a page: the pages then hold about twice the bytes of their rows at most
MIN_PAGE_OCCUPANCY = 0.5


class KeptRows(NamedTuple):
    """One layer's rows a compaction keeps (`KVCacheManager._gather_kept`)."""

    counts: list[int]  # [kv_heads] rows each head keeps
    keys: torch.Tensor  # [sum(counts), head_dim], head after head, each in its kept order
    values: torch.Tensor  # [sum(counts), head_dim]
    positions: torch.Tensor  # [kv_heads, most kept] original positions (-1 in padding)
    stats: dict  # the policy's running statistics, name -> [kv_heads, most kept]
    slots: torch.Tensor | None  # [kv_heads, most kept] each row's index in the private rows (-1 in padding)


@dataclass
class SettledLayer:
    """One layer's plan.

    head_pages: per head, (its previous pages that keep a row, in order; how many new pages)
    old_pages: every head's previous pages that keep a row, head after head
    settling_keys, settling_values: [new pages, page_tokens, head_dim] rows to quantize, head after head
    settling_heads: [new pages] the KV head of each new page
    full_keys, full_values: [rows, head_dim] the rows kept in the model's dtype, head after head
    full_counts: [kv_heads] how many of them each head keeps
    rows: [kv_heads, width] each kept row's index in [full rows, then the layer's pages restored
          in `head_pages` order], in the kept order (0 in padding)
    """

    head_pages: list[tuple[list[int], int]]
    old_pages: list[int]
    settling_keys: torch.Tensor
    settling_values: torch.Tensor
    settling_heads: torch.Tensor
    full_keys: torch.Tensor
    full_values: torch.Tensor
    full_counts: list[int]
    rows: torch.Tensor

    @property
    def new_pages(self) -> int:
        return sum(new for _, new in self.head_pages)


@dataclass
class _Head:
    """One head's rows, as indices into its kept rows."""

    staying: torch.Tensor  # [n] staying in the model's dtype
    settling: torch.Tensor  # [m] quantized now
    in_page: torch.Tensor  # [count] bool: held in a previous page
    page_row: torch.Tensor  # [count] the row in the previous region's restored pages (where in_page)
    old_pages: list[int]  # [in_page.sum()] the previous page of each row in_page, in order


def settle_layer(
    layer: int, kept: KeptRows, previous: HeadRegion | None, form: StoredForm, frozen: bool, windowed: bool
) -> SettledLayer:
    """The plan for one layer. previous: the quantized region the kept rows were gathered from, or
    None; windowed: a sliding-window layer, whose rows all stay in the model's dtype."""
    counts, keys, values, positions, _, slots = kept
    per_page = form.page_tokens()
    heads = [
        _split_head(layer, head, slots[head, :count], positions[head, :count], previous, form, frozen, windowed)
        for head, count in enumerate(counts)
    ]
    starts = [sum(counts[:head]) for head in range(len(counts))]
    staying = [head.staying for head in heads]
    full_keys, full_values = _pick(keys, starts, staying), _pick(values, starts, staying)
    settling = [len(head.settling) for head in heads]

    rows = torch.zeros(len(counts), positions.shape[1], dtype=torch.long, device=keys.device)
    head_pages, old_pages, next_slot, full_start = [], [], 0, 0
    for index, (head, count) in enumerate(zip(heads, counts)):
        old_ids = head.old_pages
        kept_pages = list(dict.fromkeys(old_ids))  # in their order, once each
        slot_of = {page: next_slot + offset for offset, page in enumerate(kept_pages)}
        new = -(-settling[index] // per_page)
        page_index = torch.zeros(count, dtype=torch.long, device=keys.device)
        if old_ids:
            page_slots = torch.tensor([slot_of[page] for page in old_ids], dtype=torch.long, device=keys.device)
            page_index[head.in_page] = page_slots * per_page + head.page_row[head.in_page] % per_page
        first_new = next_slot + len(kept_pages)
        page_index[head.settling] = first_new * per_page + torch.arange(settling[index], device=keys.device)
        head_rows = len(full_keys) + page_index
        head_rows[head.staying] = full_start + torch.arange(len(head.staying), device=keys.device)
        rows[index, :count] = head_rows
        head_pages.append((kept_pages, new))
        old_pages += kept_pages
        next_slot, full_start = first_new + new, full_start + len(head.staying)

    moving = [head.settling for head in heads]
    moving_keys, moving_values = _pick(keys, starts, moving), _pick(values, starts, moving)
    pages_per_head = torch.tensor([-(-count // per_page) for count in settling], dtype=torch.long)
    return SettledLayer(
        head_pages,
        old_pages,
        into_pages(moving_keys, settling, per_page),
        into_pages(moving_values, settling, per_page),
        torch.repeat_interleave(torch.arange(len(counts)), pages_per_head),
        full_keys,
        full_values,
        [len(head.staying) for head in heads],
        rows,
    )


def _pick(rows: torch.Tensor, starts: list[int], picks: list[torch.Tensor]) -> torch.Tensor:
    """rows [sum(counts), head_dim], head after head (head h from starts[h]) -> the rows picks[h]
    [n_h] of each head, head after head: [sum(n_h), head_dim]."""
    return torch.cat([rows[start + pick] for start, pick in zip(starts, picks)]) if picks else rows[:0]


def _split_head(
    layer: int,
    head: int,
    slots: torch.Tensor,
    positions: torch.Tensor,
    previous: HeadRegion | None,
    form: StoredForm,
    frozen: bool,
    windowed: bool,
) -> _Head:
    """slots, positions [count]: one head's kept rows, in the kept order (oldest first); `full`
    below is every row not in a previous page, `staying` those of them that are not quantized now."""
    count, device = len(slots), slots.device
    in_page = torch.zeros(count, dtype=torch.bool, device=device)
    page_row = torch.zeros(count, dtype=torch.long, device=device)
    if previous is not None:
        width = previous.valid[layer].shape[1]
        full_before = previous.full_count(layer)
        from_region = slots < width
        region_row = previous.rows[layer][head, slots.clamp(max=max(width - 1, 0))] if width else slots
        in_page = from_region & (region_row >= full_before)
        page_row = (region_row - full_before).clamp(min=0)
    # [in_page.sum()] the previous page of each row held in one
    old_pages = previous.page_ids[layer][page_row[in_page] // form.page_tokens()] if previous is not None else None
    full = (~in_page).nonzero().flatten()
    if windowed:
        return _Head(full, full[:0], in_page, page_row, [])  # every row stays
    # sinks: the oldest rows in the model's dtype, older than every quantized row
    quantized = positions[in_page]
    older = int((positions[full] < quantized.min()).sum()) if len(quantized) else len(full)
    sinks = min(form.sink_tokens, older)
    residual = len(full) - sinks
    settle = residual if frozen else int(form.settling(torch.tensor(residual)))
    staying, settling = torch.cat([full[:sinks], full[sinks + settle :]]), full[sinks : sinks + settle]
    if bool(in_page.any()):
        per_page, in_pages = form.page_tokens(), int(in_page.sum())
        pages = old_pages.unique().numel()
        # only when repacking frees pages: a head with a few quantized rows would repack every time
        frees = -(-(in_pages + len(settling)) // per_page) < pages + -(-len(settling) // per_page)
        if in_pages < MIN_PAGE_OCCUPANCY * pages * per_page and frees:
            # evictions left the pages sparse: their rows are quantized again, densely, with what
            # settles now (a rare repack, not every compaction: a cap must bound the bytes too)
            settling = torch.cat([in_page.nonzero().flatten(), settling]).sort().values
            return _Head(staying, settling, torch.zeros_like(in_page), page_row, [])
    return _Head(staying, settling, in_page, page_row, old_pages.tolist() if bool(in_page.any()) else [])
