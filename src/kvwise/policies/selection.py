"""From a ratio to the tokens kept: budgets per layer and head, and the selection that meets them.

Used by the library path (`hf.KVWiseCache`) and the engine (`engine.Compaction`, the
`KVCacheManager`'s eviction plans), so "ratio to kept tokens" is written once:

    kept_per_head(num_tokens, ratio) = max(1, round((1 - ratio) * num_tokens))

`round` is Python's: to the nearest integer, ties to the even one (57 tokens at 0.5 keep 28, 59
keep 30), computed in float64 whatever the scores' dtype. Every head keeps at least one token.
A budget scope (`Policy.budget_scope`) then decides who shares that budget: each head alone
(`head`), the heads of a layer (`layer`, Ada-KV), or every head of every layer (`global`, KVzip).
"""

from __future__ import annotations

import torch

from kvwise.policies.base import PROTECTED, Policy, keep_top_across, keep_top_per_head, split_budget
from kvwise.policies.scoring_input import ScoringInput

_MOST_BUDGET_TO_WINDOW = 0.25  # share of a head's mean budget a recent window may take


def check_ratio(ratio: float, name: str = "compression_ratio") -> float:
    """`ratio` as a float in [0, 1) (the fraction of KV removed); ValueError naming `name` otherwise."""
    value = float(ratio)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the fraction of KV removed), got {ratio}")
    return value


def check_max_kv_tokens(max_kv_tokens: int | None) -> int | None:
    """A cap on tokens per head while decoding: None, or an integer >= 1."""
    if max_kv_tokens is None:
        return None
    if int(max_kv_tokens) < 1:
        raise ValueError(f"max_kv_tokens must be a positive integer, got {max_kv_tokens}")
    return int(max_kv_tokens)


def kept_per_head(num_tokens: int, ratio: float) -> int:
    """Tokens a head keeps of `num_tokens` at `ratio`: the one rounding rule (see the module doc)."""
    return max(1, round((1.0 - ratio) * num_tokens))


def head_budgets(policy: Policy, ratio: float, num_valid: list[int], rank: int, num_layers: int) -> list[int]:
    """Tokens per head of compressing layer `rank` (of `num_layers`) for each batch entry with
    `num_valid[b]` prefill tokens; the policy's `layer_budget` weights the layers, and the total
    over layers is exactly kept_per_head x num_layers."""
    weights = [policy.layer_budget(index, num_layers, 1.0) for index in range(num_layers)]
    return [split_budget(kept_per_head(count, ratio) * num_layers, weights)[rank] for count in num_valid]


def select_in_layer(policy: Policy, scores: torch.Tensor, scoring: ScoringInput, budgets: torch.Tensor) -> torch.Tensor:
    """Keep mask [batch, num_kv_heads, seq_len] for one layer's `scores` [batch, num_kv_heads, seq_len].

    budgets: [batch] tokens per head. `head` scope: every head keeps its budget; `layer` scope:
    the heads of the layer share budgets x num_kv_heads, between the policy's floor and ceiling."""
    if policy.budget_scope == "layer":
        per_head = int(budgets.max())
        return keep_top_across(
            scores,
            scoring.valid,
            budgets * scoring.num_kv_heads,
            policy.head_floor(per_head),
            policy.head_ceiling(per_head),
        )
    return keep_top_per_head(scores, scoring.valid, budgets[:, None].expand(-1, scoring.num_kv_heads))


def select_across_layers(policy: Policy, ratio: float, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Keep mask [batch, num_layers, num_heads, seq_len] for a budget shared by every head of every
    layer (`global` scope).

    scores, valid: [batch, num_layers, num_heads, seq_len]; every head sees the same tokens, so
    valid[:, 0, 0] counts each entry's tokens. With `policy.shared_fraction`, that share of each
    head's budget goes to tokens kept in every head (`with_shared_tokens`); with
    `policy.recent_window`, the context's last tokens stay in every head (`with_recent_window`)."""
    batch, num_layers, num_heads, seq_len = valid.shape
    counts = valid[:, 0, 0].sum(dim=-1).tolist()
    per_head = torch.tensor([kept_per_head(count, ratio) for count in counts], device=scores.device)
    total = per_head * num_layers * num_heads
    if policy.shared_fraction > 0:
        num_shared = torch.tensor([round(policy.shared_fraction * kept) for kept in per_head.tolist()])
        scores = with_shared_tokens(scores, valid, num_shared.to(scores.device))
    if policy.recent_window > 0:
        # the window never takes more than a share of a head's budget: at the highest ratios the
        # scores, not the position, must choose most of what stays
        windows = (per_head * _MOST_BUDGET_TO_WINDOW).long().clamp(max=policy.recent_window)
        scores = with_recent_window(scores, valid, windows)
    most = int(per_head.max())
    return keep_top_across(
        scores.reshape(batch, num_layers * num_heads, seq_len),
        valid.reshape(batch, num_layers * num_heads, seq_len),
        total,
        policy.head_floor(most),
        policy.head_ceiling(most),
    ).view(batch, num_layers, num_heads, seq_len)


def with_shared_tokens(scores: torch.Tensor, valid: torch.Tensor, num_shared: torch.Tensor) -> torch.Tensor:
    """Protect, in every head of every layer, the tokens most heads rate highly.

    Each head's scores are scaled by its own maximum (sinks aside), averaged over all heads, and the
    `num_shared[b]` best tokens are protected everywhere; the rest of the budget stays global.

    Args:
        scores: [batch, num_layers, num_heads, seq_len]; PROTECTED marks tokens that must stay.
        valid: [batch, num_layers, num_heads, seq_len] bool.
        num_shared: [batch] int.
    """
    protected = scores >= PROTECTED / 2
    plain = scores.masked_fill(protected | ~valid, 0.0)
    normalized = plain / plain.amax(dim=-1, keepdim=True).clamp(min=1e-9)
    consensus = normalized.mean(dim=(1, 2))  # [batch, seq_len]
    everywhere = valid.all(dim=(1, 2))
    chosen = keep_top_per_head(consensus[:, None], everywhere[:, None], num_shared[:, None])[:, 0]
    return scores.masked_fill(chosen[:, None, None, :] & valid, PROTECTED)


def with_recent_window(scores: torch.Tensor, valid: torch.Tensor, window: int | torch.Tensor) -> torch.Tensor:
    """Protect the last `window` valid tokens of every head: the text just before the question.

    A query-agnostic score rates a token by what the context needs of it; the question needs the
    context's last words too (it continues them), and without them a small model loses the thread
    and answers from elsewhere, even with the needle kept in every head.

    Args:
        scores: [..., seq_len]; PROTECTED marks tokens that must stay.
        valid: [..., seq_len] bool.
        window: one int, or [batch] tensor (one per batch entry).
    """
    if isinstance(window, torch.Tensor):
        window = window.view(-1, *([1] * (valid.dim() - 1)))
    from_end = torch.flip(torch.cumsum(torch.flip(valid.int(), dims=[-1]), dim=-1), dims=[-1])
    return scores.masked_fill(valid & (from_end <= window), PROTECTED)
