"""The shared machinery of every eviction policy: budgets and top-k selection.

A policy is a dataclass whose fields are its hyperparameters. Most policies only write
`score()`; the base class turns scores into a per-head keep mask that meets the budget exactly.
Policies that move budget between layers or heads override `layer_budget` or `budget_scope`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvwise.policies.scoring_input import ScoringInput

PROTECTED = 1e30  # a score that always survives top-k, for sinks and recent windows


@dataclass
class Policy(ABC):
    """Base class. Subclasses set `name` and implement `score`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    # "head": every KV head keeps the same number of tokens; "layer": heads of one layer share
    # the layer's budget (Ada-KV); "global": all layers and heads share one budget, so the
    # compression is decided after the last layer has been scored.
    budget_scope: ClassVar[str] = "head"
    # True when the policy needs a second pass over the context (KVzip) and so can only compress
    # through `KVWiseCache.compress_context`.
    needs_context_pass: ClassVar[bool] = False
    # Names of per-token running statistics kept alongside the cache for decode-time eviction.
    stat_names: ClassVar[tuple[str, ...]] = ()
    # Global scope only: share of the budget kept as the same tokens in every head.
    shared_fraction: ClassVar[float] = 0.0
    # Global scope only: the context's last tokens, kept in every head within the budget.
    recent_window: ClassVar[int] = 0
    # True for policies that never evict (full, Quest's page selection at decode time).
    keeps_everything: ClassVar[bool] = False
    # True for policies that score from each layer's input hidden states (`ScoringInput.hidden_states`).
    needs_hidden_states: ClassVar[bool] = False

    def attach(self, model) -> None:
        """Bind what the policy needs of the model it serves (a learned head); most need nothing."""
        del model

    @abstractmethod
    def score(self, scoring: ScoringInput) -> torch.Tensor:
        """Importance of each cached token, higher is kept: [batch, num_kv_heads, seq_len]."""

    def observe(self, scoring: ScoringInput) -> dict[str, torch.Tensor]:
        """Update per-token statistics after a forward step; stateless policies keep none."""
        return {}

    def layer_budget(self, layer_idx: int, num_layers: int, mean_budget: float) -> float:
        """Tokens per head that `layer_idx` keeps; the mean over layers must equal `mean_budget`."""
        return mean_budget

    def head_floor(self, budget: int) -> int:
        """Least tokens any head keeps when budgets move between heads."""
        return 0

    def head_ceiling(self, budget: int) -> int | None:
        """Most tokens any head keeps when budgets move between heads (None: no limit)."""
        return None


def keep_top_per_head(scores: torch.Tensor, valid: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """Keep the `budgets[b, h]` best valid tokens of every head.

    Args:
        scores: [batch, num_kv_heads, seq_len]; higher is kept.
        valid: [batch, num_kv_heads, seq_len] bool.
        budgets: [batch, num_kv_heads] int; clipped to the valid count of each head.
    Returns:
        keep: [batch, num_kv_heads, seq_len] bool with exactly min(budget, valid) True per head.
    """
    masked = scores.float().masked_fill(~valid, float("-inf"))
    order = masked.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    limit = torch.minimum(budgets, valid.sum(dim=-1))
    return (rank < limit[..., None]) & valid


def keep_top_across(
    scores: torch.Tensor, valid: torch.Tensor, total_budget: torch.Tensor, floor: int, ceiling: int | None = None
) -> torch.Tensor:
    """Keep the best tokens over several heads at once (Ada-KV style), between `floor` and
    `ceiling` per head.

    Args:
        scores: [batch, groups, seq_len]; the budget is shared by the `groups` rows of a batch
            entry (heads of a layer, or every head of every layer). Scores must be comparable
            across rows.
        valid: [batch, groups, seq_len] bool.
        total_budget: [batch] int; tokens kept per batch entry over all its rows.
        floor: tokens each row keeps before the rest is shared.
        ceiling: most tokens one row may keep (None: no limit); what a full row cannot take goes
            to the next best rows.
    Returns:
        keep: [batch, groups, seq_len] bool with exactly min(total_budget, valid) True per entry
        (fewer only when the ceiling leaves no room).
    """
    batch, groups, seq_len = scores.shape
    keep = keep_top_per_head(scores, valid, torch.full((batch, groups), floor, device=scores.device))
    capacity = torch.full((batch, groups), ceiling if ceiling is not None else seq_len, device=scores.device)
    for _ in range(4 if ceiling is not None else 1):
        remaining = (total_budget - keep.sum(dim=(1, 2))).clamp(min=0)
        open_rows = (keep.sum(dim=-1) < capacity)[..., None]
        candidates = valid & ~keep & open_rows
        if not bool(candidates.any()) or not bool((remaining > 0).any()):
            break
        flat_scores = scores.float().masked_fill(~candidates, float("-inf")).reshape(batch, 1, groups * seq_len)
        extra = keep_top_per_head(flat_scores, candidates.reshape(batch, 1, groups * seq_len), remaining[:, None])
        extra = extra.view(batch, groups, seq_len)
        if ceiling is not None:
            room = (capacity - keep.sum(dim=-1)).clamp(min=0)
            extra = keep_top_per_head(scores, extra, room)
        keep = keep | extra
    return keep


def split_budget(total: int, weights: list[float]) -> list[int]:
    """Split an integer budget in proportion to `weights`; the parts sum exactly to `total`."""
    weight_sum = sum(weights)
    raw = [total * weight / weight_sum for weight in weights]
    parts = [int(value) for value in raw]
    by_remainder = sorted(range(len(raw)), key=lambda index: raw[index] - parts[index], reverse=True)
    for index in by_remainder[: total - sum(parts)]:
        parts[index] += 1
    return parts
