"""`knorm`: keep the keys with the smallest L2 norm.

Paper: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
arXiv 2406.11430. Low-norm keys tend to draw high attention, so no attention is computed.
"""

from dataclasses import dataclass

from kvwise.policies.base import Policy
from kvwise.policies.registry import register


@register
@dataclass
class KnormPolicy(Policy):
    name = "knorm"
    summary = "smallest key norms first (needs no attention)"
    paper = "https://arxiv.org/abs/2406.11430"

    def score(self, scoring):
        return -scoring.keys.float().norm(dim=-1)
