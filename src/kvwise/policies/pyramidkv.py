"""`pyramidkv`: SnapKV scores with a pyramid of per-layer budgets (more in lower layers).

Paper: Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069. Budgets fall linearly from layer 0 to the last layer; their mean is
the uniform budget, so the total memory matches the other policies at the same ratio.
"""

from dataclasses import dataclass

from kvwise.policies.base import Policy
from kvwise.policies.registry import register
from kvwise.policies.snapkv import pooled_window_votes


@register
@dataclass
class PyramidKVPolicy(Policy):
    name = "pyramidkv"
    summary = "SnapKV scores with per-layer budgets shaped like a pyramid"
    paper = "https://arxiv.org/abs/2406.02069"
    window_size: int = 64
    kernel_size: int = 5
    beta: float = 20.0  # the top layer keeps mean/beta

    def __post_init__(self):
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def layer_budget(self, layer_idx, num_layers, mean_budget):
        if num_layers == 1:
            return mean_budget
        smallest = mean_budget / self.beta
        largest = 2 * mean_budget - smallest
        return largest - (largest - smallest) * layer_idx / (num_layers - 1)

    def score(self, scoring):
        return pooled_window_votes(scoring, self.window_size, self.kernel_size)
