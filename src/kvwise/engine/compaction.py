"""`Compaction`: choosing which of a request's private tokens each KV head keeps.

Scoring happens inside the forward that computed the tokens: the attention function calls
`apply` per layer, right after that layer's attention, when the layer's queries of the chunk are
at hand (what SnapKV-style policies score with). The request's private KV (its region, then its
tail: `PrivateKV`) is read from the pool, scored, and the layer's keep mask is stored. Policies
whose budget is shared by every layer (KVzip) keep the scores instead and select over all layers
in `kept()`, after the forward (and after KVzip's reconstruction pass, `ReconstructionPass`). The
`KVCacheManager` then moves the kept tokens into head pages and frees the rest.

Budgets are the library path's (`policies.selection`): a ratio compaction keeps
`head_budgets(policy, ratio, tokens)` per head (per-layer weights for PyramidKV, shared within a
layer for Ada-KV, across all layers for KVzip); a cap (`max_kv_tokens`) then keeps at most `cap`
per head by the policy's decode-time scores. A quantized mix's ratio then fills each head's last
quantized page with its next-best tokens (`fill_pages`), as the library's cache does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvwise.engine.head_region import HeadRegion
from kvwise.kv.paged import PagedKVStorage
from kvwise.kv.stored_form import fill_pages
from kvwise.policies.base import PROTECTED, Policy, keep_top_per_head
from kvwise.policies.scoring_input import ScoringInput
from kvwise.policies.selection import head_budgets, select_across_layers, select_in_layer


@dataclass
class PrivateKV:
    """A request's private KV as padded per-head rows: its region's tokens, then its tail's.

    tail_slots: [T] int64 pool slots of the tail in order; tail_positions: [T] their positions;
    held_stats: the request's running statistics (H2O, Scissorhands) per layer, each
    [kv_heads, S'] over the rows as they were when last observed (the tail has grown since)."""

    region: HeadRegion | None
    tail_slots: torch.Tensor
    tail_positions: torch.Tensor
    kv_heads: int
    layer_slots: int  # slots of one layer in the storage (num_blocks x block_size)
    held_stats: list[dict[str, torch.Tensor]] | None = None

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """valid, positions: [kv_heads, S] (S = the region's width + T)."""
        valid = torch.ones(self.kv_heads, len(self.tail_slots), dtype=torch.bool, device=self.tail_slots.device)
        positions = self.tail_positions[None, :].expand(self.kv_heads, -1)
        if self.region is None:
            return valid, positions
        return (
            torch.cat([self.region.valid[layer], valid], dim=1),
            torch.cat([self.region.positions[layer], positions], dim=1),
        )

    def read(self, storage: PagedKVStorage, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [kv_heads, S, head_dim]: the region's rows, then the tail's."""
        keys, values = read_cells(storage, slot_cells(self.tail_slots, layer, self.kv_heads, self.layer_slots))
        if self.region is None:
            return keys, values
        region_keys, region_values = self.region.read(storage, layer)
        return torch.cat([region_keys, keys], dim=1), torch.cat([region_values, values], dim=1)

    def width(self, layer: int) -> int:
        """S: the rows of `layer(layer)`."""
        return (self.region.valid[layer].shape[1] if self.region is not None else 0) + len(self.tail_slots)

    def stats(self, layer: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Running statistics for `names`, each [kv_heads, S]: zero for tokens not yet observed."""
        held = self.held_stats[layer] if self.held_stats is not None else {}
        width, device = self.width(layer), self.tail_slots.device
        stats = {}
        for name in names:
            stat = held.get(name, torch.zeros(self.kv_heads, 0, device=device))
            stats[name] = torch.nn.functional.pad(stat, (0, width - stat.shape[1]))
        return stats


def slot_cells(slots: torch.Tensor, layer: int, kv_heads: int, layer_slots: int) -> torch.Tensor:
    """[kv_heads, n] storage cells of pool slots `slots` [n] in `layer` (see `HeadPages`)."""
    heads = torch.arange(kv_heads, device=slots.device)[:, None]
    return (layer * layer_slots + slots[None, :]) * kv_heads + heads


def read_cells(storage: PagedKVStorage, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values [*cells.shape, head_dim] of storage cells (see `HeadPages`)."""
    keys, values = storage.cells()
    return keys[cells], values[cells]


@dataclass
class Compaction:
    """One request's eviction in one forward.

    ratio_tokens: tokens per head the ratio applies to (None: no ratio in this compaction);
    cap: max_kv_tokens (None: no cap); end: the position after the chunk's last token; first,
    last: the chunk's queries in the flat step (set by the runner)."""

    request: object
    policy: Policy
    private: PrivateKV
    end: int
    num_layers: int
    ratio: float = 0.0
    ratio_tokens: int | None = None
    cap: int | None = None
    rotate_queries: object = None
    windows: tuple = ()  # per layer: its sliding window (it keeps the window, nothing is scored), or None
    chunk: object = None  # the scheduler's Chunk this compaction belongs to
    fill: tuple[int, int] | None = None  # (page_tokens, sinks) of a quantized mix's pages, else None
    first: int = 0
    last: int = 0
    keep: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [kv_heads, S] bool
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [kv_heads, S] (global scope)
    cap_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    ratio_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [kv_heads, S] (per layer)
    stats: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # layer -> name -> [kv_heads, S]

    @property
    def global_budget(self) -> bool:
        return self.ratio_tokens is not None and self.policy.budget_scope == "global"

    @property
    def needs_context_pass(self) -> bool:
        return self.ratio_tokens is not None and self.policy.needs_context_pass

    @property
    def needs_hidden_states(self) -> bool:
        return self.policy.needs_hidden_states

    @property
    def budget_layers(self) -> list[int]:
        """The layers budgets are spread over: full-attention ones (a sliding layer keeps its window)."""
        return [layer for layer in range(self.num_layers) if not self._window(layer)]

    def _window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def apply(
        self,
        storage: PagedKVStorage,
        layer: int,
        query: torch.Tensor,
        scaling: float | None,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """query: [1, num_heads, T, head_dim], the layer's flat queries of this step; hidden:
        [1, T, hidden_size], the layer's input, when the policy scores hidden states (else None)."""
        valid, positions = self.private.layer(layer)
        window = self._window(layer)
        if window:  # what the next query can still see, as transformers' sliding-window cache keeps
            self.keep[layer] = valid & (positions > self.end - window)
            return
        budget_layers = self.budget_layers
        keys, values = self.private.read(storage, layer)  # [kv_heads, S, head_dim]
        scoring = ScoringInput(
            keys=keys[None],
            values=values[None],
            valid=valid[None],
            positions=positions[None],
            queries=query[:, :, self.first : self.last],
            scaling=scaling if scaling is not None else keys.shape[-1] ** -0.5,
            layer_idx=layer,  # the model's layer (its rotary embedding, its learned scorer), as in the library
            num_layers=len(budget_layers),
            stats={name: stat[None] for name, stat in self.private.stats(layer, self.policy.stat_names).items()},
            rotate_queries=self.rotate_queries,
            hidden_states=None if hidden is None else hidden[:, self.first : self.last],
        )
        if self.policy.stat_names:
            scoring.stats = self.policy.observe(scoring)
            self.stats[layer] = {name: stat[0] for name, stat in scoring.stats.items()}
        keep = valid
        if self.ratio_tokens is not None:
            rank = budget_layers.index(layer)
            budgets = head_budgets(self.policy, self.ratio, [self.ratio_tokens], rank, len(budget_layers))
            scoring.budget, scoring.row_budgets = budgets[0], torch.tensor(budgets, device=keys.device)
            if self.global_budget:
                if not self.needs_context_pass:  # KVzip's pass scores later, in ReconstructionPass
                    self.scores[layer] = self.policy.score(scoring).float()[0]
            else:
                scores = self.policy.score(scoring)
                self.ratio_scores[layer] = scores[0]
                keep = select_in_layer(self.policy, scores, scoring, scoring.row_budgets)[0]
        if self.cap is not None:
            scoring.budget, scoring.row_budgets = self.cap, None
            self.cap_scores[layer] = self.policy.score(scoring)[0]
        self.keep[layer] = keep

    def kept(self) -> list[torch.Tensor]:
        """Keep masks [kv_heads, S] per layer, once every layer (and any context pass) has run."""
        keep = [self.keep[layer] for layer in range(self.num_layers)]
        layers = self.budget_layers
        if self.global_budget:
            widths = [keep[layer].shape[1] for layer in layers]
            width = max(widths)
            scores = torch.stack([_pad(self.scores[layer], width, 0.0) for layer in layers])
            valid = torch.stack([_pad(keep[layer], width, False) for layer in layers])  # [layers, kv_heads, width]
            chosen = select_across_layers(self.policy, self.ratio, scores[None], valid[None])[0]
            for rank, layer in enumerate(layers):
                keep[layer] = chosen[rank, :, : widths[rank]]
        if self.fill is not None and self.ratio_tokens is not None:
            page_tokens, sinks = self.fill
            for layer in layers:
                scores = self.scores[layer] if self.global_budget else self.ratio_scores[layer]
                valid, _ = self.private.layer(layer)
                keep[layer] = fill_pages(keep[layer], scores, valid, page_tokens, sinks)
        if self.cap is not None:
            for layer in layers:
                mask = keep[layer]
                if bool((mask.sum(dim=-1) > self.cap).any()):
                    budgets = torch.full((1, mask.shape[0]), self.cap, device=mask.device)
                    keep[layer] = keep_top_per_head(self.cap_scores[layer][None], mask[None], budgets)[0]
        return keep


def kept_score(compaction: Compaction, keep: list[torch.Tensor]) -> float | None:
    """The fraction of the policy's score mass (scores shifted so each head's lowest valid one is 0)
    that the kept tokens hold, over the scored layers: a cheap proxy of what the eviction lost.
    None when nothing was scored (sliding layers only)."""
    held = total = 0.0
    for layer in compaction.budget_layers:
        sources = (compaction.cap_scores, compaction.scores, compaction.ratio_scores)  # what decided, first
        scores = next((source[layer] for source in sources if layer in source), None)
        if scores is None:
            continue
        valid, _ = compaction.private.layer(layer)
        scores = scores.float()
        # protected tokens (sinks, recent windows) always stay: they are neither a gain nor a loss
        scored = valid & torch.isfinite(scores) & (scores < PROTECTED)
        lowest = scores.masked_fill(~scored, float("inf")).min(dim=-1, keepdim=True).values
        shifted = torch.where(scored, scores - lowest, torch.zeros_like(scores))
        held += float((shifted * keep[layer][..., : shifted.shape[-1]]).sum())
        total += float(shifted.sum())
    return None if total <= 0 else held / total


def _pad(tensor: torch.Tensor, width: int, value) -> torch.Tensor:
    """[rows, n] -> [rows, width], `value` in the new columns."""
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)
