"""`adakv`: per-head budgets. The heads of a layer share its budget, wrapping any scorer.

Paper: Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation",
arXiv 2407.11550. Unlike kvpress, heads really keep different numbers of tokens: the layer's
storage is variable-length per head, so the freed memory is gone. A safeguard floor
(`alpha` of the uniform budget) stops any head from being emptied.
"""

from dataclasses import dataclass

from kvwise.policies.base import Policy
from kvwise.policies.registry import make_policy, register


@register
@dataclass
class AdaKVPolicy(Policy):
    name = "adakv"
    summary = "per-head budgets within each layer around any scorer (default snapkv)"
    paper = "https://arxiv.org/abs/2407.11550"
    budget_scope = "layer"
    scorer: str = "snapkv"
    alpha: float = 0.2

    def __post_init__(self):
        if self.scorer == "adakv":
            raise ValueError("adakv cannot wrap itself")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        self.inner = make_policy(self.scorer)
        if self.inner.budget_scope != "head" or self.inner.needs_context_pass:
            raise ValueError(f"adakv wraps per-head scorers; {self.scorer!r} is not one")
        self.stat_names = self.inner.stat_names

    def head_floor(self, budget):
        return int(self.alpha * budget)

    def observe(self, scoring):
        return self.inner.observe(scoring)

    def score(self, scoring):
        return self.inner.score(scoring)
