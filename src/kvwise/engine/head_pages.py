"""Head pages: the device pool's blocks cut per (layer, KV head), for KV that heads hold unevenly.

A device block holds `block_size` tokens of every KV head of every layer:

    keys[layer][block]: [block_size, kv_heads, head_dim]

Once a policy has evicted, heads keep different tokens and different numbers of them (Ada-KV,
PyramidKV, KVzip). Keeping that in whole blocks would hold every head at the longest head's
length. So a compressed region lives in pages instead: a page is `page_tokens` consecutive slots
of one strip keys[layer][block, :, head] (a strip holds block_size / page_tokens pages), and each
(layer, head) of a request owns its own list of pages. Any page can hold any layer's and any
head's tokens (RoPE is in the keys, and the storage is one tensor for all layers), so a block's
pages serve whoever needs them: PyramidKV's full lower layers and nearly empty upper ones waste
nothing.

`HeadPages` is a slab allocator over the `BlockPool`: it takes a whole block when it runs out of
free pages and gives the block back (zeroed, through the pool's release hook) when none of its
pages is in use. Released pages are zeroed at once, so nothing a request held outlives it.

    strip = (layer * num_blocks + block) * kv_heads + head
    page  = strip * parts + part                  (parts = block_size / page_tokens)
    cell  = ((layer * num_blocks + block) * block_size + part * page_tokens + offset) * kv_heads + head

A cell indexes `PagedKVStorage.cells()`. A request wastes less than one page (page_tokens - 1
tokens) per (layer, KV head) on partly filled pages: with 4-token pages, SmolLM2's 30 layers x 3
KV heads waste at most 270 token rows per request (1,350 with whole 16-token strips).
"""

from __future__ import annotations

import math

import torch

from kvwise.core.block_pool import BlockPool
from kvwise.kv.paged import PagedKVStorage


class HeadPages:
    def __init__(self, pool: BlockPool, storage: PagedKVStorage, page_tokens: int | None = None):
        """page_tokens: tokens per page, a divisor of the block size (default: 4 where it divides)."""
        self.pool, self.storage = pool, storage
        self.block_size, self.num_blocks = pool.block_size, pool.num_blocks
        self.page_tokens = page_tokens if page_tokens is not None else math.gcd(self.block_size, 4)
        if self.block_size % self.page_tokens:
            raise ValueError(f"page_tokens must divide the block size {self.block_size}, got {self.page_tokens}")
        self.parts = self.block_size // self.page_tokens
        self.kv_heads, self.head_dim = storage.keys[0].shape[2], storage.keys[0].shape[3]
        self.num_layers = len(storage.keys)
        self.free: dict[int, None] = {}  # free pages, in the order they became free (an ordered set)
        self.pages_in_use: dict[int, int] = {}  # block -> its pages in use
        element = storage.keys[0].element_size()
        self.page_bytes = 2 * self.page_tokens * self.head_dim * element  # keys and values

    @property
    def used_pages(self) -> int:
        return sum(self.pages_in_use.values())

    @property
    def held_blocks(self) -> int:
        """Device blocks cut into pages (some of their pages may be free)."""
        return len(self.pages_in_use)

    def _pages_of(self, block: int):
        heads, blocks, parts = self.kv_heads, self.num_blocks, self.parts
        return (
            ((layer * blocks + block) * heads + head) * parts + part
            for layer in range(self.num_layers)
            for head in range(heads)
            for part in range(parts)
        )

    def allocate(self, count: int) -> list[int]:
        """`count` pages; a block comes from the pool whenever the free pages run out (the caller
        makes sure the pool has them: a compaction frees at least the blocks it needs)."""
        short = self.blocks_short(count)
        if not self.pool.can_allocate(short):  # before taking any, so a refusal leaves nothing behind
            free = self.pool.num_free
            raise ValueError(f"cannot allocate {count} head pages: {short} more blocks needed, {free} free")
        while len(self.free) < count:
            block = self.pool.allocate(1)[0]
            self.pages_in_use[block] = 0
            self.free.update(dict.fromkeys(self._pages_of(block)))
        taken = []
        for _ in range(count):
            page = next(iter(self.free))
            del self.free[page]
            self.pages_in_use[self._block(page)] += 1
            taken.append(page)
        return taken

    def _block(self, page: int) -> int:
        return page // self.parts // self.kv_heads % self.num_blocks

    def release(self, pages: list[int]) -> None:
        """Zero `pages` and free them; a block none of whose pages is in use goes back to the pool."""
        if not pages:
            return
        index = torch.tensor(pages, dtype=torch.long, device=self.storage.all_keys.device)
        cells = self._cells(index[:, None], torch.arange(self.page_tokens, device=index.device)[None, :])
        keys, values = self.storage.cells()
        keys[cells.flatten()] = 0
        values[cells.flatten()] = 0
        self.free.update(dict.fromkeys(pages))
        emptied = []
        for page in pages:
            block = self._block(page)
            self.pages_in_use[block] -= 1
            if self.pages_in_use[block] == 0:
                emptied.append(block)
        for block in emptied:
            del self.pages_in_use[block]
            for page in self._pages_of(block):
                del self.free[page]
        if emptied:
            self.pool.release(emptied)

    def cells(self, pages: list[list[int]], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cells of one layer's region: pages[head] in order hold its first counts[head] tokens.
        Returns cells [kv_heads, width] int64 (0 in padding) and valid [kv_heads, width] bool,
        width = the longest head's count."""
        width = max(counts, default=0)
        offsets = torch.arange(width, device=device)
        cells = torch.zeros(len(counts), width, dtype=torch.long, device=device)
        for head, (head_pages, count) in enumerate(zip(pages, counts)):
            if count == 0:
                continue
            page = torch.tensor(head_pages, dtype=torch.long, device=device)[offsets[:count] // self.page_tokens]
            cells[head, :count] = self._cells(page, offsets[:count] % self.page_tokens)
        return cells, offsets[None, :] < torch.tensor(counts, device=device)[:, None]

    def write(self, counts: list[int], keys: torch.Tensor, values: torch.Tensor):
        """New pages holding one layer's rows: keys, values [sum(counts), head_dim], counts[head]
        of them per head, head after head. Returns (pages [head] -> ids, cells, valid) as `cells`."""
        pages = []
        try:
            for count in counts:
                pages.append(self.allocate(-(-count // self.page_tokens)))
            cells, valid = self.cells(pages, counts, keys.device)
            all_keys, all_values = self.storage.cells()
            all_keys[cells[valid]] = keys
            all_values[cells[valid]] = values
        except BaseException:  # what this call took goes back (zeroed)
            self.release([page for head in pages for page in head])
            raise
        return pages, cells, valid

    def blocks_short(self, pages: int) -> int:
        """Device blocks to take from the pool for `pages` more pages than are free."""
        per_block = self.num_layers * self.kv_heads * self.parts
        return -(-max(0, pages - len(self.free)) // per_block)

    def _cells(self, page: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """The cell of token `offset` of page `page` (broadcast together)."""
        strip, part = page // self.parts, page % self.parts
        slot = (strip // self.kv_heads) * self.block_size + part * self.page_tokens + offset
        return slot * self.kv_heads + strip % self.kv_heads
