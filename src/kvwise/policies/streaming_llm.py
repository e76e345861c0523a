"""`streaming_llm`: attention sinks plus a recent window.

Paper: Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
"""

from dataclasses import dataclass

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register


@register
@dataclass
class StreamingLLMPolicy(Policy):
    name = "streaming_llm"
    summary = "first tokens (attention sinks) plus the most recent window"
    paper = "https://arxiv.org/abs/2309.17453"
    num_sinks: int = 4

    def __post_init__(self):
        if self.num_sinks < 0:
            raise ValueError(f"num_sinks must be >= 0, got {self.num_sinks}")

    def score(self, scoring):
        recency = scoring.positions.float()
        return recency.masked_fill(scoring.sink_mask(self.num_sinks), PROTECTED)
