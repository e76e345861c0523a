"""`keydiff`: keep the keys least similar to the mean key.

Paper: Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments", arXiv 2504.15364. Distinctive keys carry
distinctive content; no attention is computed.
"""

from dataclasses import dataclass

import torch.nn.functional as F

from kvwise.policies.base import Policy
from kvwise.policies.registry import register


@register
@dataclass
class KeyDiffPolicy(Policy):
    name = "keydiff"
    summary = "keys least similar (cosine) to the mean key"
    paper = "https://arxiv.org/abs/2504.15364"

    def score(self, scoring):
        keys = F.normalize(scoring.keys.float(), dim=-1)
        weights = scoring.valid.float()[..., None]
        anchor = F.normalize(
            (keys * weights).sum(dim=2, keepdim=True) / weights.sum(dim=2, keepdim=True).clamp(min=1), dim=-1
        )
        return -(keys * anchor).sum(dim=-1)
