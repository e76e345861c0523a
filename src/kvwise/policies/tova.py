"""`tova`: keep the tokens the newest query attends to most.

Paper: Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104. As in the paper, the
attention is averaged over all heads of the layer, so every head keeps the same tokens.
"""

from dataclasses import dataclass

from kvwise.policies.base import Policy
from kvwise.policies.registry import register


@register
@dataclass
class TOVAPolicy(Policy):
    name = "tova"
    summary = "attention of the newest query, averaged over the layer's heads"
    paper = "https://arxiv.org/abs/2401.06104"
    per_head: bool = False  # deviation knob: score each KV head separately

    def score(self, scoring):
        received = scoring.attention_received(last_queries=1)
        if self.per_head:
            return received
        return received.mean(dim=1, keepdim=True).expand_as(received)
