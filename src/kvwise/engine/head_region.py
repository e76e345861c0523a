"""`HeadRegion`: a request's compressed private KV, each (layer, KV head) with its own tokens.

After an eviction a request's KV is three parts, read in this order by attention:

    shared prefix    device blocks, every head the same tokens (the prefix cache's, untouched)
    region           head pages (`HeadPages`): what the policy kept, counts[layer][head] tokens each
    tail             device blocks: the tokens computed since, every head the same tokens

The region replaces the private tokens it was made from; their blocks went back to the pool.
`cells`, `valid` and `positions` are the region as padded per-head rows, made once when the region
is written (the runner and the next eviction read them every step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HeadRegion:
    pages: list[list[list[int]]]  # [layer][head] -> page ids, in token order
    counts: list[list[int]]  # [layer][head] -> tokens held
    cells: list[torch.Tensor]  # [layer] -> [kv_heads, width] int64: storage cell of each token (0 in padding)
    valid: list[torch.Tensor]  # [layer] -> [kv_heads, width] bool
    positions: list[torch.Tensor]  # [layer] -> [kv_heads, width] int64 original positions (-1 in padding)

    @property
    def num_pages(self) -> int:
        return sum(len(head) for layer in self.pages for head in layer)

    @property
    def num_tokens(self) -> int:
        """Tokens held over every layer and head."""
        return sum(sum(layer) for layer in self.counts)

    def longest(self) -> int:
        """The most tokens any head of any layer holds."""
        return max((max(layer) for layer in self.counts), default=0)
