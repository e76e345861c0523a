"""`Compaction`: evicting a request's private tokens inside the forward that computed them.

The attention function runs it per layer, right after that layer's attention: the layer's
queries of the chunk are at hand there (what SnapKV-style policies score with), and the
request's private KV is read from its blocks, scored, and the kept tokens of each KV head are
written back to the first slots of the private region. Heads keep different tokens, each at its
RoPE-rotated original position, so slot order does not matter to attention. After the forward
the engine releases the blocks past the kept length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvwise.kv.paged import PagedKVStorage
from kvwise.policies.base import Policy
from kvwise.policies.scoring_input import ScoringInput
from kvwise.policies.selection import select_in_layer


@dataclass
class Compaction:
    """slots: [L] pool slots of the private region in order; positions: [num_layers, kv_heads, L]
    each slot's original token position; queries [first, last) of the flat step; keep: tokens
    per head kept; end: the position after the chunk's last token."""

    request: object
    policy: Policy
    slots: torch.Tensor
    positions: torch.Tensor
    first: int
    last: int
    keep: int
    end: int  # the position after the chunk's last token
    kept_positions: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [kv_heads, keep]

    def apply(self, storage: PagedKVStorage, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """query: [1, num_heads, T, head_dim], the layer's flat queries of this step."""
        keys_flat = storage.keys[layer].view(-1, *storage.keys[layer].shape[2:])  # [slots, kv_heads, dim]
        values_flat = storage.values[layer].view(-1, *storage.values[layer].shape[2:])
        keys, values = keys_flat[self.slots], values_flat[self.slots]  # [L, kv_heads, dim] (copies)
        heads, length = keys.shape[1], keys.shape[0]
        valid = torch.ones(1, heads, length, dtype=torch.bool, device=keys.device)
        positions = self.positions[layer]
        scoring = ScoringInput(
            keys=keys.transpose(0, 1)[None],
            values=values.transpose(0, 1)[None],
            valid=valid,
            positions=positions[None],
            queries=query[:, :, self.first : self.last],
            scaling=scaling if scaling is not None else keys.shape[-1] ** -0.5,
            layer_idx=layer,
            num_layers=len(storage.keys),
            budget=self.keep,
        )
        budgets = torch.full((1,), self.keep, device=keys.device)
        kept = select_in_layer(self.policy, self.policy.score(scoring), scoring, budgets)[0]  # [kv_heads, L]
        # the kept slots of each head in their original order: True sorts first under a stable sort
        order = torch.argsort((~kept).to(torch.int8), dim=-1, stable=True)[:, : self.keep]  # [kv_heads, keep]
        index = order.t()[..., None].expand(-1, -1, keys.shape[-1])  # [keep, kv_heads, dim]
        keys_flat[self.slots[: self.keep]] = keys.gather(0, index)
        values_flat[self.slots[: self.keep]] = values.gather(0, index)
        self.kept_positions[layer] = positions.gather(1, order)
