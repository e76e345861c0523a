"""`random`: keep a uniformly random subset; the floor any scorer must beat."""

from dataclasses import dataclass

import torch

from kvwise.policies.base import Policy
from kvwise.policies.registry import register


@register
@dataclass
class RandomPolicy(Policy):
    name = "random"
    summary = "keep a random subset of tokens (a lower bound for scorers)"
    seed: int = 0

    def score(self, scoring):
        generator = torch.Generator(device="cpu").manual_seed(self.seed + scoring.layer_idx)
        return torch.rand(scoring.valid.shape, generator=generator).to(scoring.keys.device)
