"""What a policy sees when it scores the cached tokens of one layer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

NEG_INF = float("-inf")


@dataclass
class ScoringInput:
    """One layer's cache, padded per KV head, plus the queries of the forward that just ran.

    Shapes (same names everywhere):
        keys, values: [batch, num_kv_heads, seq_len, head_dim], RoPE already applied to keys.
        valid: [batch, num_kv_heads, seq_len] bool; False marks padding slots that hold no token.
        positions: [batch, num_kv_heads, seq_len] int; each token's original position.
        queries: [batch, num_heads, query_len, head_dim]; the queries of the tokens in the last
            `query_len` slots of every head (RoPE applied).
        stats: per-token running statistics of stateful policies (H2O, Scissorhands), each
            [batch, num_kv_heads, seq_len] float32 and aligned with `keys`.
        hidden_states: [batch, query_len, hidden_size], the layer's attention input for the
            queries' tokens, when the policy asked for it (`needs_hidden_states`); else None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor
    scaling: float
    layer_idx: int
    num_layers: int
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    # Tokens per head this selection keeps (the mean when budgets move between heads/layers).
    budget: int = 0
    # The same per batch entry, [batch] int64: rows of a padded batch hold different lengths.
    row_budgets: torch.Tensor | None = None
    # rotate_queries(queries, delta, layer_idx): move RoPE-rotated queries `delta` positions later; None
    # when the model's rotary embedding is not the standard rotate-half form.
    rotate_queries: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    hidden_states: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    @property
    def query_len(self) -> int:
        return self.queries.shape[2]

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    def attention_probs(self, query_start: int, query_end: int) -> torch.Tensor:
        """Softmax attention of queries [query_start, query_end) over the cache, causal and padding-masked.

        Returns [batch, num_kv_heads, group_size, query_end - query_start, seq_len] float32. Only the
        requested rows are computed, so callers stream over query chunks and never hold L x L.
        """
        queries = self.queries[:, :, query_start:query_end]
        # Query row r sits at slot seq_len - query_len + query_start + r; later slots are its future.
        first_slot = self.seq_len - self.query_len + query_start
        return self.probs_for(queries, first_slot)

    def probs_for(self, queries: torch.Tensor, first_slot: int | torch.Tensor | None) -> torch.Tensor:
        """Softmax attention of `queries` [batch, num_heads, rows, head_dim] over the cache.

        Row r may see slots <= first_slot + r (or <= first_slot[r] for a [rows] tensor);
        `first_slot=None` lets every row see every valid slot.
        Returns [batch, num_kv_heads, group_size, rows, seq_len] float32.
        """
        batch, num_kv_heads, seq_len, head_dim = self.keys.shape
        num_rows = queries.shape[2]
        grouped = queries.float().reshape(batch, num_kv_heads, self.group_size * num_rows, head_dim)
        logits = torch.matmul(grouped, self.keys.float().transpose(-1, -2)).mul_(self.scaling)
        logits = logits.view(batch, num_kv_heads, self.group_size, num_rows, seq_len)
        allowed = self.valid[:, :, None, None, :]
        if first_slot is not None:
            row_slots = first_slot
            if not isinstance(first_slot, torch.Tensor):
                row_slots = first_slot + torch.arange(num_rows, device=self.keys.device)
            causal = torch.arange(seq_len, device=self.keys.device)[None, :] <= row_slots[:, None]
            allowed = allowed & causal[None, None, None]
        logits.masked_fill_(~allowed, NEG_INF)
        probs = torch.softmax(logits, dim=-1)
        return probs.nan_to_num_(nan=0.0)

    def attention_received(
        self, last_queries: int | None = None, reduce: str = "sum", chunk_size: int = 256
    ) -> torch.Tensor:
        """Attention each cached token receives from the last `last_queries` queries (all if None).

        Probabilities are averaged over the query heads of each GQA group, then reduced over
        query rows with `reduce` ("sum" or "max"). Returns [batch, num_kv_heads, seq_len] float32.
        """
        num_queries = self.query_len if last_queries is None else min(last_queries, self.query_len)
        received = torch.zeros(self.keys.shape[:3], dtype=torch.float32, device=self.keys.device)
        for start in range(self.query_len - num_queries, self.query_len, chunk_size):
            end = min(start + chunk_size, self.query_len)
            per_row = self.attention_probs(start, end).mean(dim=2)  # [batch, heads, rows, seq_len]
            # A padding query attends to nothing real; its row must not vote.
            first_new = self.seq_len - self.query_len
            per_row = per_row * self.valid[:, :, first_new + start : first_new + end, None]
            if reduce == "sum":
                received += per_row.sum(dim=2)
            elif reduce == "max":
                received = torch.maximum(received, per_row.amax(dim=2))
            else:
                raise ValueError(f"unknown reduce {reduce!r}; choose 'sum' or 'max'")
        return received

    def budget_share(self, fraction: float) -> torch.Tensor:
        """`fraction` of each batch entry's budget, in tokens: [batch] int64."""
        budgets = self.row_budgets if self.row_budgets is not None else torch.tensor([self.budget])
        return (budgets.float() * fraction).long().to(self.valid.device)

    def recent_mask(self, window: int | torch.Tensor) -> torch.Tensor:
        """True for the last `window` valid tokens of each head: [batch, num_kv_heads, seq_len].

        `window` is one int, or a [batch] tensor with one per batch entry."""
        if isinstance(window, torch.Tensor):
            window = window.view(-1, 1, 1)
        newest_position = self.positions.masked_fill(~self.valid, -1).amax(dim=-1, keepdim=True)
        return self.valid & (self.positions > newest_position - window)

    def sink_mask(self, num_sinks: int) -> torch.Tensor:
        """True for the first `num_sinks` valid tokens of each head: [batch, num_kv_heads, seq_len]."""
        rank = torch.cumsum(self.valid.int(), dim=-1)
        return self.valid & (rank <= num_sinks)
