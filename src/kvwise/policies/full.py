"""`full`: keep every token. The reference every other policy is measured against."""

from dataclasses import dataclass

from kvwise.policies.base import Policy
from kvwise.policies.registry import register


@register
@dataclass
class FullPolicy(Policy):
    name = "full"
    summary = "keep every token (the uncompressed baseline)"
    keeps_everything = True

    def score(self, scoring):
        # Under a decode budget the oldest tokens go first, as in a plain sliding window.
        return scoring.positions.float()
