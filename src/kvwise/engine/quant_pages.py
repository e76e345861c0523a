"""`QuantPages`: head pages stored quantized, for a request that evicts and asks for `kv_quant`.

Evict first, then quantize what is kept: when a compaction writes a request's region (what each
(layer, KV head) kept, `HeadRegion`), a request with a quantizer gets its pages here instead of
in the device pool. The pages follow the mix's `StoredForm`, as the library's cache does: each
head's first `sink_tokens` kept tokens stay in the model's dtype (held by the region), and the
rest is quantized in pages of one group each (`page_tokens`: a KIVI key group, or
`PER_TOKEN_PAGE` tokens for per-token codecs). A ratio's compaction fills each head's last page
(`fill_pages`); a cap's may leave it short, padded with copies of the head's own first row. A
cap's later compactions keep each quantized row in its page (never quantized twice) and quantize
only rows leaving the residual window (`engine/settled_region.py`). Pages are restored to the
model's dtype for attention; the bytes saved are real. Freed pages are zeroed.
"""

from __future__ import annotations

import torch

from kvwise.core.block_pool import BlockPool
from kvwise.kv.blocks import QuantizedBlocks
from kvwise.kv.paged import PagedKVStorage
from kvwise.kv.quantizer import Quantizer
from kvwise.kv.stored_form import StoredForm


class QuantPages:
    def __init__(self, quantizer: Quantizer, storage: PagedKVStorage, token_capacity: int):
        """quantizer: ready for the model (`Quantizer.attach`: a low-rank codec's bases);
        token_capacity: tokens of one head it can hold (allocated up front, quantized)."""
        self.name = quantizer.spec
        self.quantizer = quantizer
        self.form = StoredForm.of(self.quantizer)
        layer = storage.keys[0]
        self.page_tokens, self.dtype, self.head_dim = (
            self.form.page_tokens(),
            layer.dtype,
            layer.shape[-1],
        )
        capacity = max(1, token_capacity // self.page_tokens)
        self.pages = QuantizedBlocks(self.quantizer, capacity, self.page_tokens, 1, layer.shape[-1], layer.device)
        # A page is one head of one layer; a per-head codec (low-rank) needs to know which.
        # lowrank always projects keys; without bases (not attached) its codec says so on first use
        self.layer_starts = self.quantizer.key_codec.starts if self.quantizer.needs_heads else None
        per_head = self.layer_starts is not None
        self.page_bases = torch.zeros(capacity, dtype=torch.int32, device=layer.device) if per_head else None
        self.ids = BlockPool(capacity, self.page_tokens)
        self.ids.on_release(self._zero)
        self.page_bytes = self.pages.nbytes() // capacity + (4 if per_head else 0)
        self.device = layer.device

    def store(self, keys: torch.Tensor, values: torch.Tensor, layer: int = 0, heads=None) -> list[int] | None:
        """Quantize pages keys, values [n, page_tokens, head_dim] of `layer`'s KV heads `heads` [n];
        their ids, or None when full."""
        if keys.shape[0] == 0:  # every row of these heads stays in the model's dtype (a sliding window)
            return []
        if not self.ids.can_allocate(keys.shape[0]):
            return None
        ids = self.ids.allocate(keys.shape[0])
        index = torch.tensor(ids, device=self.device)
        bases = None
        if self.page_bases is not None:
            bases = heads.to(self.device) + self.layer_starts[layer]
            self.page_bases[index] = bases.to(torch.int32)
            bases = bases[:, None].long()
        self.pages.write(index, keys[:, :, None], values[:, :, None], bases)
        return ids

    def read(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [n, page_tokens, head_dim] in the model's dtype."""
        if ids.numel() == 0:
            empty = torch.zeros(0, self.page_tokens, self.head_dim, dtype=self.dtype, device=self.device)
            return empty, empty
        bases = None if self.page_bases is None else self.page_bases[ids][:, None].long()
        keys, values = self.pages.read(ids, self.dtype, bases)
        return keys[:, :, 0], values[:, :, 0]

    def _tables(self) -> dict[str, torch.Tensor]:
        tables = {
            f"{role}.{name}": table
            for role, pool in (("keys", self.pages.keys), ("values", self.pages.values))
            for name, table in (*pool.per_token.items(), *pool.per_group.items())
        }
        if self.page_bases is not None:
            tables["pages.bases"] = self.page_bases
        return tables

    def export(self, ids: list[int]) -> dict[str, torch.Tensor]:
        """The stored codes and scales of pages `ids`, by name (for a tier: restored bit for bit)."""
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        return {name: table[index].cpu() for name, table in self._tables().items()}

    def restore(self, stored: dict[str, torch.Tensor], count: int) -> list[int] | None:
        """New ids for `count` pages whose codes and scales are `stored` (from `export`); None when
        full or when `stored` does not fit this store (another quantizer's layout)."""
        tables = self._tables()
        fits = set(stored) == set(tables) and all(
            stored[name].shape == (count, *table.shape[1:]) and stored[name].dtype == table.dtype
            for name, table in tables.items()
        )
        if not fits or not self.ids.can_allocate(count):
            return None
        ids = self.ids.allocate(count)
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        for name, table in tables.items():
            table[index] = stored[name].to(self.device)
        return ids

    def release(self, ids: list[int]) -> None:
        if ids:
            self.ids.release(ids)

    def used_bytes(self) -> int:
        return self.ids.stats().used * self.page_bytes

    def _zero(self, ids: list[int]) -> None:
        self.pages.zero(torch.tensor(ids, device=self.device))
