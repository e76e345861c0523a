"""`quest`: query-aware page selection at decode time. Nothing is evicted.

Paper: Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv 2406.10774. Keys are grouped in pages; each page keeps per-channel min and max, which bound
q.k from above. A decode step attends only to the top pages (plus the newest page), so it reads
a fraction of the cache: `KVWiseCache.bytes_read_last_step()` reports that, while `nbytes()`
stays at the full size. `compression_ratio` is the fraction of pages skipped. Deviation: the
page bounds are recomputed from the keys each step rather than kept beside them.
"""

import math
from dataclasses import dataclass

import torch

from kvwise.policies.base import Policy
from kvwise.policies.registry import register


@register
@dataclass
class QuestPolicy(Policy):
    name = "quest"
    summary = "keeps every token; each decode step reads only the top-K pages (query-aware)"
    paper = "https://arxiv.org/abs/2406.10774"
    keeps_everything = True
    page_size: int = 16

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    def score(self, scoring):
        # Only used under a decode budget: keep the most recent tokens.
        return scoring.positions.float()

    def select_pages(self, step, query, ratio):
        """Keys/values of the selected pages plus the new tokens, and the pages' validity.

        Args:
            query: [batch, num_heads, 1, head_dim].
        Returns:
            keys, values: [batch, num_kv_heads, num_selected * page_size + 1, head_dim];
            prefix_valid: [batch, num_kv_heads, num_selected * page_size] bool.
        """
        prefix_len = step.prefix_len
        batch, num_kv_heads, _, head_dim = step.keys.shape
        num_pages = math.ceil(prefix_len / self.page_size)
        num_selected = max(1, math.ceil((1.0 - ratio) * num_pages))
        if num_selected >= num_pages:
            return step.keys, step.values, step.valid[:, :, :prefix_len]
        pad = num_pages * self.page_size - prefix_len
        keys = torch.nn.functional.pad(step.keys[:, :, :prefix_len], (0, 0, 0, pad))
        valid = torch.nn.functional.pad(step.valid[:, :, :prefix_len], (0, pad))
        paged = keys.view(batch, num_kv_heads, num_pages, self.page_size, head_dim).float()
        paged_valid = valid.view(batch, num_kv_heads, num_pages, self.page_size, 1)
        page_max = paged.masked_fill(~paged_valid, float("-inf")).amax(dim=3)
        page_min = paged.masked_fill(~paged_valid, float("inf")).amin(dim=3)
        grouped = query[:, :, 0].float().view(batch, num_kv_heads, -1, 1, head_dim)
        bound = torch.maximum(grouped * page_max[:, :, None], grouped * page_min[:, :, None]).sum(dim=-1)
        bound = torch.nan_to_num(bound.amax(dim=2), nan=float("-inf"), posinf=float("inf"))
        bound[:, :, -1] = float("inf")  # the newest page is always read
        pages = bound.topk(num_selected, dim=-1).indices.sort(dim=-1).values
        slots = (pages[..., None] * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten(2)
        slots = slots.clamp(max=prefix_len - 1)
        in_range = (pages[..., None] * self.page_size + torch.arange(self.page_size, device=pages.device)).flatten(
            2
        ) < prefix_len
        gather = slots[..., None].expand(-1, -1, -1, head_dim)
        new_keys, new_values = step.keys[:, :, prefix_len:], step.values[:, :, prefix_len:]
        selected_keys = torch.cat([step.keys.gather(2, gather), new_keys], dim=2)
        value_gather = slots[..., None].expand(-1, -1, -1, step.values.shape[-1])
        selected_values = torch.cat([step.values.gather(2, value_gather), new_values], dim=2)
        selected_valid = step.valid.gather(2, slots) & in_range
        return selected_keys, selected_values, selected_valid
