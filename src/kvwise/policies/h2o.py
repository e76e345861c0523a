"""`h2o`: heavy hitters by accumulated attention, plus a recent window.

Paper: Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models", arXiv 2306.14048. The accumulated attention is computed over query chunks, so
the prefill never holds an L x L matrix. Scores are averaged within each GQA group.
"""

from dataclasses import dataclass

import torch

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register


@register
@dataclass
class H2OPolicy(Policy):
    name = "h2o"
    summary = "accumulated attention (heavy hitters) plus a recent window"
    paper = "https://arxiv.org/abs/2306.14048"
    stat_names = ("accumulated_attention",)
    recent_fraction: float = 0.5  # share of the budget given to the recent window, as in the paper

    def __post_init__(self):
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError(f"recent_fraction must be in [0, 1], got {self.recent_fraction}")

    def observe(self, scoring):
        previous = scoring.stats.get("accumulated_attention", torch.zeros_like(scoring.valid, dtype=torch.float32))
        return {"accumulated_attention": previous + scoring.attention_received()}

    def score(self, scoring):
        accumulated = scoring.stats.get("accumulated_attention")
        if accumulated is None:
            accumulated = scoring.attention_received()
        recent = scoring.recent_mask(scoring.budget_share(self.recent_fraction))
        return accumulated.masked_fill(recent, PROTECTED)
