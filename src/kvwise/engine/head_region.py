"""`HeadRegion`: a request's compressed private KV, each (layer, KV head) with its own tokens.

After an eviction a request's KV is three parts, read in this order by attention:

    shared prefix    device blocks, every head the same tokens (the prefix cache's, untouched)
    region           pages: what the policy kept, counts[layer][head] tokens each
    tail             device blocks: the tokens computed since, every head the same tokens

The region replaces the private tokens it was made from; their blocks went back to the pool.
Its pages are device head pages (`HeadPages`, read in place through `cells`), or quantized pages
(`QuantPages`, restored through `page_ids` and `rows`) when the request asked for `kv_quant`.
Quantized, the rows a head keeps in the model's dtype (the mix's `StoredForm`) are its sinks, held
here (`sink_keys`, `sink_values`: one row or so per head), or, while a capped request decodes,
its sinks and residual window, up to a window and a group of rows per head: those live in device
head pages of the pool (`full_pages`, read through `full_cells`), so the pool's blocks count them
and admission sees them. `rows` index the full rows, then the restored pages; a page may hold
rows no longer kept (a cap evicted them, and the rows it keeps keep their codes), which no row
index names.
`valid` and `positions` describe the region as padded per-head rows, made once when it is
written (the runner and the next eviction read them every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvwise.kv.paged import PagedKVStorage


@dataclass
class HeadRegion:
    pages: list[list[list[int]]]  # [layer][head] -> page ids, in token order
    counts: list[list[int]]  # [layer][head] -> tokens held
    valid: list[torch.Tensor]  # [layer] -> [kv_heads, width] bool
    positions: list[torch.Tensor]  # [layer] -> [kv_heads, width] int64 original positions (-1 in padding)
    cells: list[torch.Tensor] | None = None  # device pages: [layer] -> [kv_heads, width] storage cells
    quant: object = None  # QuantPages holding the pages, or None (device pages)
    page_ids: list[torch.Tensor] | None = None  # quantized: [layer] -> [P] its page ids, head after head
    rows: list[torch.Tensor] | None = None  # quantized: [layer] -> [kv_heads, width] rows of the restored pages
    # quantized: [layer] -> [rows, head_dim] each head's rows in the model's dtype, head after head
    sink_keys: list[torch.Tensor] | None = None
    sink_values: list[torch.Tensor] | None = None
    # or quantized and capped: [layer] -> [rows] the full rows' storage cells, head after head, in
    # the device head pages full_pages
    full_cells: list[torch.Tensor] | None = None
    full_pages: list[int] = field(default_factory=list)
    full_page_bytes: int = 0  # one device head page's keys and values
    page_bytes: int = 0  # one page's keys and values as stored (device or quantized)
    holders: int = 1  # requests reading it, plus the compressed-prefix cache when published there
    _stacked: tuple | None = field(default=None, repr=False)
    # quantized: (layer, keys, values) as `read` last restored them. A step reads a layer's region
    # twice (its attention, then a policy observing it) and pages never change under a region, so
    # the second read is the first's; one layer only, dropped after the step's forward
    # (`forget_read`), so the region stays quantized in memory.
    _last_read: tuple | None = field(default=None, repr=False)

    def read(self, storage: PagedKVStorage, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [kv_heads, width, head_dim] of `layer` (zeros or copies in padding)."""
        if self.quant is None:
            keys, values = storage.cells()
            return keys[self.cells[layer]], values[self.cells[layer]]
        if self._last_read is not None and self._last_read[0] == layer:
            return self._last_read[1], self._last_read[2]
        keys, values = self.quant.read(self.page_ids[layer])  # [P, page_tokens, head_dim]
        full_keys, full_values = self.full_rows(storage, layer)
        keys = torch.cat([full_keys, keys.flatten(0, 1)])[self.rows[layer]]
        values = torch.cat([full_values, values.flatten(0, 1)])[self.rows[layer]]
        self._last_read = (layer, keys, values)
        return keys, values

    def forget_read(self) -> None:
        """Drop the last restored layer (after a step: between steps the region is held quantized)."""
        self._last_read = None

    def full_rows(self, storage: PagedKVStorage, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantized: keys, values [rows, head_dim] of the rows `layer` keeps in the model's dtype,
        head after head."""
        if self.full_cells is None:
            return self.sink_keys[layer], self.sink_values[layer]
        keys, values = storage.cells()
        return keys[self.full_cells[layer]], values[self.full_cells[layer]]

    def full_count(self, layer: int) -> int:
        """Quantized: how many rows `layer` keeps in the model's dtype, every head together."""
        return (self.sink_keys if self.full_cells is None else self.full_cells)[layer].shape[0]

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Device pages only: cells [layers, kv_heads, width] (padded to the widest layer) and
        counts [layers, kv_heads], made once (the CPU decode kernel reads them every step)."""
        if self._stacked is None:
            width = max(cells.shape[1] for cells in self.cells)
            cells = torch.stack([torch.nn.functional.pad(cells, (0, width - cells.shape[1])) for cells in self.cells])
            self._stacked = (cells, torch.tensor(self.counts, device=cells.device))
        return self._stacked

    @property
    def num_pages(self) -> int:
        return sum(len(head) for layer in self.pages for head in layer)

    @property
    def sink_bytes(self) -> int:
        """The full rows' bytes, as held (whole pages when they live in the pool)."""
        pages = len(self.full_pages) * self.full_page_bytes
        if self.sink_keys is None:
            return pages
        return pages + sum(keys.nbytes + values.nbytes for keys, values in zip(self.sink_keys, self.sink_values))

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes + self.sink_bytes

    def zero_sinks(self) -> None:
        """Overwrite the sinks and the last restored layer, so nothing a request held outlives it
        (pages are zeroed by their store)."""
        restored = self._last_read[1:] if self._last_read is not None else ()
        for tensor in (*(self.sink_keys or ()), *(self.sink_values or ()), *restored):
            tensor.zero_()
        self._last_read = None

    def longest(self) -> int:
        """The most tokens any head of any layer holds."""
        return max((max(layer) for layer in self.counts), default=0)
