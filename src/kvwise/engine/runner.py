"""`ModelRunner`: runs transformers model modules over the paged pool, many sequences per forward.

All scheduled tokens (prefill chunks and decode tokens of every running request) go through the
model as one flat sequence with their own positions; RoPE comes from the model. The attention
function registered as `kvwise_paged` writes each layer's new keys and values into the request's
blocks, then lets each chunk attend over its whole sequence read back through its block table:
one padded SDPA call per layer for all decode tokens and one per prefill chunk, GQA
without repeat_kv. No model is rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvwise.engine.scheduler import Chunk
from kvwise.kv.paged import PagedKVStorage

ATTENTION_NAME = "kvwise_paged"


@dataclass
class AttentionGroup:
    """Chunks attended together in one padded SDPA call.

    table: [C, max_blocks] block ids (padded with 0); query_index: [C, max_q] flat token index of
    each chunk's queries (-1 padding); mask: [C, 1, max_q, max_keys] bool, causal per sequence.
    """

    table: torch.Tensor
    query_index: torch.Tensor
    mask: torch.Tensor


@dataclass
class StepLayout:
    """Where each flat token goes, for one forward: slots [T] int64 pool slot of each token, and
    the attention groups (all decode tokens together; each prefill chunk on its own, so one long
    chunk never pads every decode query to its length)."""

    storage: PagedKVStorage
    slots: torch.Tensor
    groups: list[AttentionGroup]


_current: StepLayout | None = None


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, num_heads, T, head_dim]; key, value: [1, num_kv_heads, T, head_dim] (flat tokens)."""
    layout = _current
    if layout is None:
        raise RuntimeError("kvwise_paged attention runs only inside ModelRunner.forward")
    layer = module.layer_idx
    layout.storage.write(layer, layout.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    flat_queries = query[0].transpose(0, 1)  # [T, heads, dim]
    flat_output = torch.empty_like(flat_queries)
    for group in layout.groups:
        keys = layout.storage.keys[layer][group.table]  # [C, max_blocks, block_size, kv_heads, dim]
        values = layout.storage.values[layer][group.table]
        padded = flat_queries[group.query_index.clamp(min=0)]  # [C, max_q, heads, dim]
        output = F.scaled_dot_product_attention(
            padded.transpose(1, 2),
            keys.flatten(1, 2).transpose(1, 2),  # [C, kv_heads, max_keys, dim]
            values.flatten(1, 2).transpose(1, 2),
            attn_mask=group.mask,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )  # [C, heads, max_q, dim]
        valid = group.query_index >= 0
        flat_output[group.query_index[valid]] = output.transpose(1, 2)[valid]
    return flat_output[None], None  # [1, T, heads, dim]


def _no_mask(*args, **kwargs):
    return None  # masks come from the block tables, not from transformers


def register_paged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


class ModelRunner:
    def __init__(self, model, storage: PagedKVStorage):
        register_paged_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        self.model, self.storage, self.block_size = model, storage, storage.block_size

    @torch.no_grad()
    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Compute the chunks' tokens; returns the logits after each chunk's last token: [C, vocab]."""
        global _current
        device = self.model.device
        layout = self._layout(chunks, device)
        ids = torch.tensor([[t for c in chunks for t in c.request.tokens[c.start : c.end]]], device=device)
        positions = torch.tensor([[p for c in chunks for p in range(c.start, c.end)]], device=device)
        last = torch.tensor([c.end - c.start for c in chunks], device=device).cumsum(0) - 1
        _current = layout
        try:
            logits = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=0).logits
        finally:
            _current = None
        return logits[0, last]

    def _layout(self, chunks: list[Chunk], device) -> StepLayout:
        block = self.block_size
        slots = [c.request.blocks[p // block] * block + p % block for c in chunks for p in range(c.start, c.end)]
        offsets, offset = [], 0
        for chunk in chunks:
            offsets.append(offset)
            offset += chunk.end - chunk.start
        decodes = [index for index, chunk in enumerate(chunks) if chunk.end - chunk.start == 1]
        prefills = [[index] for index, chunk in enumerate(chunks) if chunk.end - chunk.start > 1]
        groups = [
            self._group([chunks[i] for i in members], [offsets[i] for i in members], device)
            for members in ([decodes] if decodes else []) + prefills
        ]
        return StepLayout(self.storage, torch.tensor(slots, device=device), groups)

    def _group(self, chunks: list[Chunk], offsets: list[int], device) -> AttentionGroup:
        block = self.block_size
        max_blocks = max(-(-c.end // block) for c in chunks)
        table = [c.request.blocks[: -(-c.end // block)] + [0] * (max_blocks - -(-c.end // block)) for c in chunks]
        max_q = max(c.end - c.start for c in chunks)
        query_index = [
            list(range(offset, offset + c.end - c.start)) + [-1] * (max_q - (c.end - c.start))
            for c, offset in zip(chunks, offsets)
        ]
        starts = torch.tensor([c.start for c in chunks], device=device)
        ends = torch.tensor([c.end for c in chunks], device=device)
        query_positions = starts[:, None] + torch.arange(max_q, device=device)  # [C, max_q]
        key_positions = torch.arange(max_blocks * block, device=device)
        mask = (key_positions[None, None, :] <= query_positions[:, :, None]) & (
            key_positions[None, None, :] < ends[:, None, None]
        )
        mask = mask | ~mask.any(dim=-1, keepdim=True)  # padding queries see something: no NaN
        return AttentionGroup(
            torch.tensor(table, device=device), torch.tensor(query_index, device=device), mask[:, None]
        )
