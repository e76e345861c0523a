"""One full-attention layer of a `KVWiseCache`: variable-length storage per KV head.

Storage is flat: every kept token of every (batch entry, KV head) pair, in that order, so heads
and batch entries may keep different numbers of tokens and the memory really shrinks.

    store:     a `KVStore` holding keys and values, quantized or not; store.lengths [batch, num_kv_heads]
    positions: [num_entries] int32, each token's slot in the original sequence, or None while
               every head holds exactly slots 0..n-1 (nothing evicted, no padding)
    stats:     name -> [num_entries] float32, per-token statistics of decode-time policies

Each forward goes update() -> kvwise attention -> after_attention(): `update` lays the cache out
padded per head next to the new tokens, attention reads that layout, and `after_attention` (which
sees the queries) scores, selects and writes the kept tokens back flat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from kvwise.hf.quant_probe import attention_error_of_spill
from kvwise.kv import ragged
from kvwise.kv.store import KVStore
from kvwise.policies.base import keep_top_per_head
from kvwise.policies.scoring_input import ScoringInput

if TYPE_CHECKING:
    from kvwise.hf.cache import KVWiseCache


@dataclass
class PendingStep:
    """The padded layout of one forward, between `update` and `after_attention`.

    keys, values: [batch, num_kv_heads, prefix_len + query_len, head_dim]
    valid, positions: [batch, num_kv_heads, prefix_len + query_len]
    stats: name -> [batch, num_kv_heads, prefix_len + query_len] float32
    """

    layer: CompressingLayer
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    stats: dict[str, torch.Tensor]
    prefix_len: int


class CompressingLayer(CacheLayerMixin):
    """A full-attention cache layer that evicts tokens per head according to its cache's policy."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, layer_idx: int, owner: KVWiseCache):
        super().__init__()
        self.layer_idx = layer_idx
        self.owner = owner
        self.seen_tokens = 0
        self.positions: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self.attention_input: torch.Tensor | None = None  # [batch, query_len, hidden], set by a hook
        self.context_scores: torch.Tensor | None = None  # [batch, num_kv_heads, seq_len] from a context pass
        self.bytes_read_last_step = 0
        self.attention_error: float | None = None  # of the most recent commit that quantized tokens
        self.store: KVStore | None = None
        self._probe: tuple[torch.Tensor, float] | None = None
        self.spills_since_probe = 0
        self._pending: PendingStep | None = None

    # ---- CacheLayerMixin -------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, num_kv_heads, _, head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.batch_size, self.num_kv_heads, self.head_dim = batch, num_kv_heads, head_dim
        quantizer = self.owner.quantizer
        self.store = KVStore(key_states, value_states, quantizer and quantizer.for_layer(self.layer_idx))
        # None means implicit: every head holds slots 0..n-1, until something is evicted or padded.
        self.positions = None
        self.is_initialized = True

    @property
    def lengths(self) -> torch.Tensor | None:
        """[batch, num_kv_heads] int64: tokens held per head."""
        return self.store.lengths if self.is_initialized else None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Lay out the cache next to the new tokens for attention; storage changes after attention.

        Args:
            key_states, value_states: [batch, num_kv_heads, query_len, head_dim], RoPE applied.
        Returns:
            keys, values: [batch, num_kv_heads, prefix_len + query_len, head_dim].
        """
        if self._pending is not None:
            raise RuntimeError(
                "KVWiseCache needs the model to run kvwise attention; build the cache with "
                "KVWiseCache(model, ...) or load the model with kvwise.load_model()"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, num_kv_heads, query_len, _ = key_states.shape
        prefix_keys, prefix_values, prefix_valid = self.padded()
        prefix_positions = self.padded_positions(prefix_valid)
        new_positions = torch.arange(
            self.seen_tokens, self.seen_tokens + query_len, dtype=torch.int32, device=self.device
        ).expand(batch, num_kv_heads, query_len)
        new_valid = torch.ones(batch, num_kv_heads, query_len, dtype=torch.bool, device=self.device)
        step = PendingStep(
            layer=self,
            keys=torch.cat([prefix_keys, key_states], dim=2),
            values=torch.cat([prefix_values, value_states], dim=2),
            valid=torch.cat([prefix_valid, new_valid], dim=2),
            positions=torch.cat([prefix_positions, new_positions], dim=2),
            stats={
                name: torch.cat([self._pad_entries(flat), torch.zeros_like(new_valid, dtype=torch.float32)], dim=2)
                for name, flat in self.stats.items()
            },
            prefix_len=prefix_keys.shape[2],
        )
        self._pending = step
        keys = step.keys.detach()  # a fresh tensor object that can carry the step to attention
        keys.kvwise_step = step
        return keys, step.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Masks are sized to the logical sequence, so the last `query_length` columns describe the
        # new tokens (their padding included) whatever was evicted.
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        # The logical length: new tokens continue from the original positions.
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = self.positions = self._probe = self.attention_error = None
        self.stats, self.context_scores, self._pending = {}, None, None
        self.seen_tokens = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_batch(torch.arange(self.batch_size, device=self.device).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a compressed KV cache cannot be cropped: evicted tokens are gone")

    def offload(self):
        raise ValueError("KVWiseCache layers do not support transformers offloading")

    # ---- sizes -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes held by this layer's tensors: the KV store (codes, scales, residual, lengths),
        positions and statistics."""
        if not self.is_initialized:
            return 0
        tensors = [*self.stats.values()] + ([] if self.positions is None else [self.positions])
        return self.store.nbytes() + sum(tensor.nbytes for tensor in tensors)

    def kept_tokens(self) -> torch.Tensor:
        """Tokens kept per head: [batch, num_kv_heads] int64."""
        return self.lengths.clone()

    def kept_positions(self) -> torch.Tensor:
        """[batch, num_kv_heads, max_len] int32: the original position of each token held, per head,
        in `padded()`'s order (padding slots are not meaningful; `padded()`'s valid marks them)."""
        return self.padded_positions(self._slot_valid())

    # ---- padded <-> flat ---------------------------------------------------------------------
    def _slot_valid(self) -> torch.Tensor:
        """[batch, num_kv_heads, max_len] bool: which padded slots hold a token."""
        max_len = int(self.lengths.max()) if self.lengths.numel() else 0
        return torch.arange(max_len, device=self.device) < self.lengths[..., None]

    def _pad_entries(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat [num_entries, ...] -> padded [batch, num_kv_heads, max_len, ...], zeros in padding."""
        return ragged.pad(flat, self.lengths.flatten(), (self.batch_size, self.num_kv_heads))

    def padded_positions(self, valid: torch.Tensor) -> torch.Tensor:
        """[batch, num_kv_heads, max_len] int32 original slots of the stored tokens."""
        if self.positions is None:
            return torch.arange(valid.shape[-1], dtype=torch.int32, device=self.device).expand(valid.shape)
        return self._pad_entries(self.positions)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """keys, values [batch, num_kv_heads, max_len, head_dim] and valid [batch, num_kv_heads, max_len]."""
        return self.store.padded()

    def _commit(self, step: PendingStep, keep: torch.Tensor, query: torch.Tensor | None = None, scaling=None) -> None:
        """Store the kept slots of `step` flat. `keep`: [batch, num_kv_heads, slots] bool.

        `query` [batch, num_heads, query_len, head_dim], when given, probes the attention error
        of whatever this commit quantized."""
        if self.positions is not None or not bool(keep.all()):
            self.positions = step.positions[keep].to(torch.int32)
        self.stats = {name: stat[keep] for name, stat in step.stats.items()}
        if query is not None and self.store.quantizer is not None:
            self._probe = (query[:, :, -1:], scaling)  # [batch, num_heads, 1, head_dim]: for a later flush
        spill = self.store.commit(step.keys, step.values, keep, spill=not self.owner.quantization_deferred)
        if spill is not None and query is not None:
            # Sampled: the probe costs about a tenth of a prefill chunk's quantization work.
            if self.spills_since_probe % self.owner.error_probe_every == 0:
                self.attention_error = attention_error_of_spill(
                    step.keys, step.values, keep, spill, query[:, :, -1:], scaling
                )
            self.spills_since_probe += 1

    def _stored_step(self) -> PendingStep:
        """The stored tokens in the padded layout, as a step with no new tokens."""
        keys, values, valid = self.padded()
        stats = {name: self._pad_entries(stat) for name, stat in self.stats.items()}
        return PendingStep(self, keys, values, valid, self.padded_positions(valid), stats, keys.shape[2])

    def _select_batch(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        heads = ragged.heads_of_batch(indices.to(self.device), self.num_kv_heads)
        counts = self.lengths.flatten()
        if self.positions is not None:
            self.positions = ragged.gather_heads(self.positions, counts, heads)[0]
        self.stats = {name: ragged.gather_heads(stat, counts, heads)[0] for name, stat in self.stats.items()}
        self.store.select_batch(indices)
        self.batch_size = int(indices.shape[0])

    # ---- the step after attention ------------------------------------------------------------
    def keys_for_attention(self, step: PendingStep, query: torch.Tensor):
        """Keys, values and prefix validity that the new queries attend over (Quest narrows them)."""
        selector = getattr(self.owner.policy, "select_pages", None)
        prefix_valid = step.valid[:, :, : step.prefix_len]
        if selector is None or query.shape[2] != 1:
            self.bytes_read_last_step = step.keys.nbytes + step.values.nbytes
            return step.keys, step.values, prefix_valid
        keys, values, prefix_valid = selector(step, query, self.owner.compression_ratio)
        self.bytes_read_last_step = keys.nbytes + values.nbytes
        return keys, values, prefix_valid

    def after_attention(
        self, step: PendingStep, query: torch.Tensor, new_valid: torch.Tensor | None, scaling: float
    ) -> None:
        """Score, select and store. `query`: [batch, num_heads, query_len, head_dim];
        `new_valid`: [batch, query_len] bool (False for padding) or None."""
        self._pending = None
        owner, policy = self.owner, self.owner.policy
        query_len = query.shape[2]
        if new_valid is not None:
            step.valid[:, :, step.prefix_len :] &= new_valid[:, None, :]
        scoring = ScoringInput(
            keys=step.keys,
            values=step.values,
            valid=step.valid,
            positions=step.positions,
            queries=query,
            scaling=scaling,
            layer_idx=self.layer_idx,
            num_layers=owner.num_compressing_layers,
            stats=step.stats,
            rotate_queries=owner.rotate_queries,
            hidden_states=self.attention_input,
        )
        self.attention_input = None
        if owner.in_context_pass:
            # KVzip's reconstruction pass: score the context, keep none of the repeated tokens.
            reconstruction = policy.score_reconstruction(scoring)[:, :, : step.prefix_len]
            self.context_scores = (
                reconstruction if self.context_scores is None else torch.maximum(self.context_scores, reconstruction)
            )
            self._commit(step, step.valid & (torch.arange(step.valid.shape[2], device=self.device) < step.prefix_len))
            return
        self.seen_tokens += query_len
        compress_now = owner.should_compress(self, step.prefix_len)
        if policy.stat_names and (compress_now or owner.max_kv_tokens is not None):
            scoring.stats = step.stats = policy.observe(scoring)
        if owner.max_kv_tokens is None:
            step.stats = {}  # statistics only serve decode-time eviction; do not hold them otherwise
        keep = step.valid
        if compress_now:
            keep = owner.select_for_layer(self, scoring)
        if owner.max_kv_tokens is not None and bool((keep.sum(dim=-1) > owner.max_kv_tokens).any()):
            budgets = torch.full(keep.shape[:2], owner.max_kv_tokens, device=self.device)
            keep = keep_top_per_head(owner.decode_scores(scoring), keep, budgets)
        self._commit(step, keep, query, scaling)
        if compress_now:
            owner.layer_compressed(self)

    def flush(self) -> None:
        """Quantize every token still at full precision (the end of `compress_context`)."""
        if not self.is_initialized or self.store.quantizer is None:
            return
        keys, values, valid = self.padded()
        spill = self.store.flush()
        if spill is not None and self._probe is not None:
            query, scaling = self._probe
            self.attention_error = attention_error_of_spill(keys, values, valid, spill, query, scaling)

    def apply_keep(self, keep: torch.Tensor) -> None:
        """Evict from the stored cache. `keep`: [batch, num_kv_heads, max_len] bool over `padded()`."""
        step = self._stored_step()
        self._commit(step, keep & step.valid)
