"""The quantizer interface: encode rows of keys or values into packed codes plus metadata.

A codec sees the rows of many heads at once, flat: [num_tokens, head_dim]. Its metadata is either
per token (a scale per token, or per channel group of a token) or per token group (KIVI keys: one
scale per channel for a run of consecutive tokens of one head). `Encoded` keeps both kinds apart
so tokens can be evicted and heads merged without ever quantizing anything again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from kvwise.kv import ragged

METADATA_DTYPE = torch.float16  # scales and zeros: 16 bits whatever the model's dtype


@dataclass
class Encoded:
    """Quantized rows of one role (keys or values).

    per_token: name -> [num_tokens, ...]; always holds "codes" (uint8, packed).
    per_group: name -> [num_groups, ...]; empty unless the codec groups tokens.
    group_sizes: [num_groups] int16, tokens in each group (consecutive rows); None if ungrouped.
    """

    per_token: dict[str, torch.Tensor]
    per_group: dict[str, torch.Tensor] = field(default_factory=dict)
    group_sizes: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.per_token["codes"].shape[0]

    @property
    def num_groups(self) -> int:
        return 0 if self.group_sizes is None else self.group_sizes.shape[0]

    def nbytes(self) -> int:
        tensors = [*self.per_token.values(), *self.per_group.values()]
        if self.group_sizes is not None:
            tensors.append(self.group_sizes)
        return sum(tensor.nbytes for tensor in tensors)

    def group_of_tokens(self) -> torch.Tensor:
        """[num_tokens] int64: the group of each token row."""
        return ragged.head_of_rows(self.group_sizes.long())

    def select(self, keep: torch.Tensor, groups_per_head: torch.Tensor) -> tuple[Encoded, torch.Tensor]:
        """Drop token rows. `keep`: [num_tokens] bool; `groups_per_head`: [num_heads] int64.

        Returns the kept rows and the new groups per head. Codes are copied, never re-quantized:
        a group that loses tokens keeps its scale, and a group left empty is dropped.
        """
        per_token = {name: tensor[keep] for name, tensor in self.per_token.items()}
        if self.group_sizes is None:
            return Encoded(per_token), groups_per_head
        kept_sizes = torch.bincount(self.group_of_tokens()[keep], minlength=self.num_groups)
        alive = kept_sizes > 0
        group_heads = ragged.head_of_rows(groups_per_head)
        new_groups_per_head = torch.bincount(group_heads[alive], minlength=groups_per_head.numel())
        per_group = {name: tensor[alive] for name, tensor in self.per_group.items()}
        return Encoded(per_token, per_group, kept_sizes[alive].to(torch.int16)), new_groups_per_head

    def gather_heads(self, tokens_per_head, groups_per_head, heads) -> Encoded:
        """The rows of the given heads, in that order (see `ragged.gather_heads`)."""
        per_token = {name: ragged.gather_heads(t, tokens_per_head, heads)[0] for name, t in self.per_token.items()}
        if self.group_sizes is None:
            return Encoded(per_token)
        per_group = {name: ragged.gather_heads(t, groups_per_head, heads)[0] for name, t in self.per_group.items()}
        sizes = ragged.gather_heads(self.group_sizes, groups_per_head, heads)[0]
        return Encoded(per_token, per_group, sizes)


def append_by_head(old: Encoded | None, old_tokens, old_groups, new: Encoded, new_tokens, new_groups) -> Encoded:
    """Per head, `old`'s rows followed by `new`'s. Counts are [num_heads] int64 tensors."""
    if old is None:
        return new
    token_plan = ragged.interleave_plan(old_tokens, new_tokens)
    per_token = {
        name: ragged.apply_plan(old.per_token[name], new.per_token[name], token_plan) for name in new.per_token
    }
    if new.group_sizes is None:
        return Encoded(per_token)
    group_plan = ragged.interleave_plan(old_groups, new_groups)
    per_group = {
        name: ragged.apply_plan(old.per_group[name], new.per_group[name], group_plan) for name in new.per_group
    }
    sizes = ragged.apply_plan(old.group_sizes, new.group_sizes, group_plan)
    return Encoded(per_token, per_group, sizes)


def concat_encoded(parts: list[Encoded]) -> Encoded:
    """The rows of several `Encoded` one after another (not per head): for decoding in one pass."""
    if len(parts) == 1:
        return parts[0]
    per_token = {name: torch.cat([part.per_token[name] for part in parts]) for name in parts[0].per_token}
    per_group = {name: torch.cat([part.per_group[name] for part in parts]) for name in parts[0].per_group}
    sizes = None if parts[0].group_sizes is None else torch.cat([part.group_sizes for part in parts])
    return Encoded(per_token, per_group, sizes)


class Codec(ABC):
    """Encodes and decodes rows of one role. Subclasses document their code and metadata shapes."""

    bits: int
    groups_tokens: bool = False  # True when metadata is shared by a run of consecutive tokens
    needs_heads: bool = False  # True when the code depends on each row's KV head (a per-head basis)

    @abstractmethod
    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        """rows: [num_tokens, head_dim]; group_sizes: [num_groups] tokens per group (token-grouping codecs)."""

    @abstractmethod
    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        """-> [num_tokens, head_dim] in `dtype`."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a clear error if this codec cannot hold rows of `head_dim` channels (any width by default)."""
        return None

    # Stores call these two: they know which KV head each row is of. Codecs whose code depends
    # on the head (a per-head basis) override them; the rest ignore `heads`.
    def encode_heads(self, rows: torch.Tensor, group_sizes: torch.Tensor | None, heads: torch.Tensor | None) -> Encoded:
        """`encode` of rows whose KV heads are `heads` [num_tokens] int64 (None unless `needs_heads`)."""
        return self.encode(rows, group_sizes)

    def decode_heads(self, encoded: Encoded, dtype: torch.dtype, heads: torch.Tensor | None) -> torch.Tensor:
        """`decode` of rows whose KV heads are `heads` [num_tokens] int64 (None unless `needs_heads`)."""
        return self.decode(encoded, dtype)
