"""KVzip's reconstruction pass through the engine's own runner.

KVzip scores a context by how much a model asked to repeat it attends to each token. In the
library path that is a second forward through `KVWiseCache.compress_context`; here it is a second
forward in the same step, right after the one that computed the context, for every request whose
compaction needs one (batched together):

    the request's context KV  +  [repeat prompt, end of turn, the context again]
                                  (positions after the context, in borrowed blocks)

Each layer's reconstruction queries attend over everything before them, the scores of the
context's tokens go to the request's `Compaction`, and the pass's own KV is dropped: its blocks
are the request's own private ones past the context (released by the compaction anyway) and a
few borrowed ones, zeroed and given back when the pass ends.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvwise.engine.block_table import BlockTable
from kvwise.engine.compaction import Compaction, read_cells, slot_cells
from kvwise.engine.request import Request
from kvwise.engine.scheduler import Chunk
from kvwise.kv.paged import PagedKVStorage
from kvwise.policies.scoring_input import ScoringInput


@dataclass
class ContextPass:
    """One request's reconstruction pass: `chunk` is the pass's tokens on a stand-in request that
    shares the request's blocks; prefix_slots [P] and pass_slots [m] are the pool slots of the
    shared prefix and of the pass's tokens."""

    compaction: Compaction
    policy: object  # a copy of the request's KVzip policy: it records where the re-read starts
    chunk: object
    prefix_slots: torch.Tensor
    pass_slots: torch.Tensor
    first: int = 0
    last: int = 0

    def apply(self, storage: PagedKVStorage, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """Score the context's tokens by the pass's queries of `layer` ([1, heads, T, head_dim])."""
        if layer not in self.compaction.budget_layers:
            return  # a sliding-window layer keeps its window whatever the scores
        private = self.compaction.private
        private_valid, _ = private.layer(layer)
        private_keys, private_values = private.read(storage, layer)
        prefix_keys, prefix_values = read_cells(
            storage, slot_cells(self.prefix_slots, layer, private.kv_heads, private.layer_slots)
        )
        pass_keys, pass_values = read_cells(
            storage, slot_cells(self.pass_slots, layer, private.kv_heads, private.layer_slots)
        )
        keys = torch.cat([prefix_keys, private_keys, pass_keys], dim=1)  # [kv_heads, P + S + m, head_dim]
        values = torch.cat([prefix_values, private_values, pass_values], dim=1)
        heads, width, private_width = keys.shape[0], prefix_keys.shape[1], private_keys.shape[1]
        valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
        valid[:, width : width + private_width] = private_valid
        scoring = ScoringInput(
            keys=keys[None],
            values=values[None],
            valid=valid[None],
            positions=torch.arange(keys.shape[1], device=keys.device).expand(heads, -1)[None],
            queries=query[:, :, self.first : self.last],
            scaling=scaling if scaling is not None else keys.shape[-1] ** -0.5,
            layer_idx=self.compaction.budget_layers.index(layer),
            num_layers=len(self.compaction.budget_layers),
        )
        scores = self.policy.score_reconstruction(scoring)[0, :, width : width + private_width]
        previous = self.compaction.scores.get(layer)
        self.compaction.scores[layer] = scores if previous is None else torch.maximum(previous, scores)


def plan_context_passes(compactions: list[Compaction], kv, tokenizer) -> tuple[list[ContextPass], list[int]]:
    """The passes for `compactions` that need one, and the device blocks borrowed for them (give
    them back with `kv.pool.release` after the forward). Raises when the pool cannot hold a pass."""
    passes, borrowed = [], []
    block_size = kv.block_size
    device = kv.storage.keys[0].device
    try:
        for compaction in compactions:
            request = compaction.request
            policy = copy.copy(compaction.policy)
            context = torch.tensor([request.tokens[: compaction.end]])
            pass_ids = policy.context_pass_inputs(context, None, tokenizer)[0][0].tolist()
            start = compaction.end - request.kv_offset  # KV index of the first pass token
            needed = -(-(start + len(pass_ids)) // block_size) - len(request.blocks)
            if needed > 0 and not kv.can_borrow(needed):
                raise MemoryError(
                    f"the KV pool cannot hold KVzip's reconstruction pass of {len(pass_ids)} tokens for "
                    f"{request.request_id}; give the engine more blocks or compress less at once"
                )
            extra = kv.pool.allocate(needed) if needed > 0 else []
            borrowed += extra
            stand_in = Request(request.tokens[: compaction.end] + pass_ids, kv_offset=request.kv_offset)
            stand_in.blocks = BlockTable(request.blocks.block_ids + extra)
            stand_in.region = request.region
            indices = torch.arange(start, start + len(pass_ids), device=device)
            prefix = torch.arange(request.reused, device=device)
            passes.append(
                ContextPass(
                    compaction,
                    policy,
                    Chunk(stand_in, compaction.end, compaction.end + len(pass_ids)),
                    _slots(stand_in, prefix, block_size),
                    _slots(stand_in, indices, block_size),
                )
            )
    except Exception:
        if borrowed:
            kv.pool.release(borrowed)
        raise
    return passes, borrowed


def _slots(request: Request, indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] pool slots of KV indices `indices` [n] of `request`'s blocks."""
    blocks = torch.tensor(request.blocks.block_ids, dtype=torch.long, device=indices.device)
    return blocks[indices // block_size] * block_size + indices % block_size
