"""`snapkv`: votes of an observation window of recent queries, pooled along the sequence.

Paper: Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
arXiv 2404.14469. Attention is recomputed only for the window (never L x L), averaged within
each GQA group, summed over the window, and max-pooled so neighbours of a hit survive with it.
The window itself is always kept.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register


def pooled_window_votes(scoring, window_size: int, kernel_size: int) -> torch.Tensor:
    """SnapKV's scores: [batch, num_kv_heads, seq_len], window slots protected."""
    votes = scoring.attention_received(last_queries=window_size)
    batch, num_kv_heads, seq_len = votes.shape
    if kernel_size > 1:
        votes = F.max_pool1d(
            votes.reshape(batch * num_kv_heads, 1, seq_len), kernel_size, stride=1, padding=kernel_size // 2
        ).view(batch, num_kv_heads, seq_len)
    return votes.masked_fill(scoring.recent_mask(window_size), PROTECTED)


@register
@dataclass
class SnapKVPolicy(Policy):
    name = "snapkv"
    summary = "observation-window attention votes, pooled, averaged per GQA group"
    paper = "https://arxiv.org/abs/2404.14469"
    window_size: int = 64
    kernel_size: int = 5

    def __post_init__(self):
        if self.window_size < 1 or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError("snapkv needs window_size >= 1 and an odd kernel_size >= 1")

    def score(self, scoring):
        return pooled_window_votes(scoring, self.window_size, self.kernel_size)
