"""`expected_attention`: attention that future queries are expected to pay, times value norm.

Paper: Devoto et al., "Expected Attention: KV Cache Compression by Estimating Attention from
Future Queries Distribution", arXiv 2510.00636 (kvpress's ExpectedAttentionPress). Queries are
modelled as Gaussian from the statistics of the last `window_size` queries; for a Gaussian q,
E[exp(q.k s)] = exp(mu.k s + s^2 k^T Sigma k / 2). Deviation: we use the RoPE-rotated queries
as they are (no averaging of rotations over future positions) and a diagonal covariance.
"""

from dataclasses import dataclass

import torch

from kvwise.policies.base import PROTECTED, Policy
from kvwise.policies.registry import register


@register
@dataclass
class ExpectedAttentionPolicy(Policy):
    name = "expected_attention"
    summary = "expected attention of future queries (Gaussian model) times value norm"
    paper = "https://arxiv.org/abs/2510.00636"
    window_size: int = 64
    num_sinks: int = 4
    epsilon: float = 1e-2

    def score(self, scoring):
        window = scoring.queries[:, :, -self.window_size :].float()  # [batch, heads, window, head_dim]
        mean = window.mean(dim=2)
        variance = window.var(dim=2, unbiased=False)
        batch, num_kv_heads, seq_len, head_dim = scoring.keys.shape
        group = scoring.group_size
        keys = scoring.keys.float()
        mean = mean.view(batch, num_kv_heads, group, head_dim)
        variance = variance.view(batch, num_kv_heads, group, head_dim)
        logits = torch.einsum("bhgd,bhkd->bhgk", mean, keys) * scoring.scaling
        logits = logits + 0.5 * scoring.scaling**2 * torch.einsum("bhgd,bhkd->bhgk", variance, keys * keys)
        logits = logits.masked_fill(~scoring.valid[:, :, None], float("-inf"))
        expected = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0).mean(dim=2)
        scores = (expected + self.epsilon) * scoring.values.float().norm(dim=-1)
        return scores.masked_fill(scoring.sink_mask(self.num_sinks), PROTECTED)
