"""`scissorhands`: persistence of importance. Tokens that were pivotal stay pivotal.

Paper: Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV
Cache Compression at Test Time", arXiv 2305.17118. A token scores one point each time a query in
the history window gives it more than average attention (1 / visible tokens); the lowest counts
go first and a recent window is always kept.
"""

from dataclasses import dataclass

import torch

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register


@register
@dataclass
class ScissorhandsPolicy(Policy):
    name = "scissorhands"
    summary = "counts of above-average attention over a history window, plus a recent window"
    paper = "https://arxiv.org/abs/2305.17118"
    stat_names = ("importance_count",)
    history_window: int = 128
    recent_fraction: float = 0.1
    chunk_size: int = 128

    def __post_init__(self):
        if self.history_window < 1 or not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError("scissorhands needs history_window >= 1 and recent_fraction in [0, 1]")

    def observe(self, scoring):
        counts = scoring.stats.get("importance_count", torch.zeros_like(scoring.valid, dtype=torch.float32)).clone()
        first = max(0, scoring.query_len - self.history_window)
        for start in range(first, scoring.query_len, self.chunk_size):
            end = min(start + self.chunk_size, scoring.query_len)
            probs = scoring.attention_probs(start, end).mean(dim=2)  # [batch, heads, rows, seq_len]
            visible = (probs > 0).sum(dim=-1, keepdim=True).clamp(min=1)
            counts += (probs > 1.0 / visible).float().sum(dim=2)
        return {"importance_count": counts}

    def score(self, scoring):
        counts = scoring.stats.get("importance_count")
        if counts is None:
            counts = self.observe(scoring)["importance_count"]
        # Ties (common with integer counts) fall to the older token.
        scores = counts + scoring.positions.float() / (scoring.positions.max().float() + 1)
        return scores.masked_fill(scoring.recent_mask(scoring.budget_share(self.recent_fraction)), PROTECTED)
