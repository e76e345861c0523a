"""KVzip's reconstruction pass through the engine's own runner, chunk by chunk in its steps.

KVzip scores a context by how much a model asked to repeat it attends to each token. In the
library path that is a second forward through `KVWiseCache.compress_context`. Here, once the
forward that computed the context is done, the request gets a `ReconstructionPass`:

    the request's context KV  +  [repeat prompt, end of turn, the context again]
                                  (positions after the context, on borrowed blocks)

The scheduler runs the pass like a prefill, in chunks within the step's token budget and batched
with everyone else's work (`PassChunk`), so a long document's pass never holds up other requests
for longer than a prefill chunk would. Each layer's reconstruction queries attend over
everything before them; the scores of the context's tokens go to the request's `Compaction`
(the highest over the chunks). When the last chunk is done the compaction is applied and the
pass's own KV is dropped: its blocks are the request's private ones past the context (released
by the compaction anyway) and the borrowed ones, zeroed and given back. The request waits,
neither decoding nor prefilling, while its pass runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from kvwise.engine.block_table import BlockTable
from kvwise.engine.compaction import Compaction, read_cells, slot_cells
from kvwise.engine.request import Request
from kvwise.engine.scheduler import Chunk
from kvwise.kv.paged import PagedKVStorage
from kvwise.policies.scoring_input import ScoringInput


@dataclass
class ReconstructionPass:
    """request's pass: `stand_in` holds the context and the pass's tokens (positions from `start`),
    on the request's blocks and `borrowed` ones; prefix_slots [P] and pass_slots [m] are the pool
    slots of the shared prefix and of the pass's tokens."""

    request: Request
    compaction: Compaction
    policy: object  # a copy of the request's KVzip policy: it records where the re-read starts
    stand_in: Request
    borrowed: list[int]
    prefix_slots: torch.Tensor
    pass_slots: torch.Tensor
    start: int
    done: int = 0  # pass tokens computed so far
    chunk: Chunk | None = field(default=None, repr=False)  # this step's chunk of it
    first: int = 0  # where the runner put the chunk's queries in the flat step
    last: int = 0

    @property
    def length(self) -> int:
        return len(self.pass_slots)

    @property
    def remaining(self) -> int:
        return self.length - self.done

    def next_chunk(self, budget: int) -> PassChunk:
        begin = self.start + self.done
        self.chunk = PassChunk(self.stand_in, begin, begin + min(self.remaining, budget), self)
        return self.chunk

    def apply(
        self, storage: PagedKVStorage, layer: int, query: torch.Tensor, scaling: float | None, hidden=None
    ) -> None:
        """Score the context's tokens by this chunk's queries of `layer` ([1, heads, T, head_dim])."""
        compaction = self.compaction
        if layer not in compaction.budget_layers:
            return  # a sliding-window layer keeps its window whatever the scores
        private = compaction.private
        private_valid, _ = private.layer(layer)
        private_keys, private_values = private.read(storage, layer)
        seen = self.pass_slots[: self.chunk.end - self.start]  # the pass up to this chunk's last query
        prefix_keys, prefix_values = read_cells(
            storage, slot_cells(self.prefix_slots, layer, private.kv_heads, private.layer_slots)
        )
        pass_keys, pass_values = read_cells(storage, slot_cells(seen, layer, private.kv_heads, private.layer_slots))
        keys = torch.cat([prefix_keys, private_keys, pass_keys], dim=1)  # [kv_heads, P + S + seen, head_dim]
        values = torch.cat([prefix_values, private_values, pass_values], dim=1)
        heads, width, private_width = keys.shape[0], prefix_keys.shape[1], private_keys.shape[1]
        valid = torch.ones(keys.shape[:2], dtype=torch.bool, device=keys.device)
        valid[:, width : width + private_width] = private_valid
        budget_layers = compaction.budget_layers
        scoring = ScoringInput(
            keys=keys[None],
            values=values[None],
            valid=valid[None],
            positions=torch.arange(keys.shape[1], device=keys.device).expand(heads, -1)[None],
            queries=query[:, :, self.first : self.last],
            scaling=scaling if scaling is not None else keys.shape[-1] ** -0.5,
            layer_idx=layer,  # the model's layer: its rotary embedding
            num_layers=len(budget_layers),
        )
        scores = self.policy.score_reconstruction(scoring)[0, :, width : width + private_width]
        previous = compaction.scores.get(layer)
        compaction.scores[layer] = scores if previous is None else torch.maximum(previous, scores)


class PassDeferred(MemoryError):
    """The pool cannot lend a reconstruction pass's blocks now, though it could once others finish:
    the request is recomputed later instead of failing."""


@dataclass
class PassChunk(Chunk):
    """A chunk of a reconstruction pass: computed like a prefill chunk, sampled never."""

    reconstruction: ReconstructionPass | None = None

    @property
    def owner(self) -> Request:
        return self.reconstruction.request


def start_pass(compaction: Compaction, kv, tokenizer) -> ReconstructionPass:
    """The pass for `compaction`, with its blocks borrowed from the pool (`kv.can_borrow` first);
    raises PassDeferred when the blocks are in use now, MemoryError when the pool could never hold it."""
    request, block_size = compaction.request, kv.block_size
    device = kv.device
    policy = copy.copy(compaction.policy)
    context = torch.tensor([request.tokens[: compaction.end]])
    pass_ids = policy.context_pass_inputs(context, None, tokenizer)[0][0].tolist()
    start = compaction.end - request.kv_offset  # KV index of the first pass token
    needed = max(0, -(-(start + len(pass_ids)) // block_size) - len(request.blocks))
    if needed and not kv.can_borrow(needed):
        if needed + len(request.blocks) <= kv.num_blocks:
            raise PassDeferred(f"the pass of {request.request_id} waits for {needed} free blocks")
        raise MemoryError(
            f"the KV pool cannot hold KVzip's reconstruction pass of {len(pass_ids)} tokens for "
            f"{request.request_id}; give the engine more blocks or compress less at once"
        )
    borrowed = kv.lend_blocks(needed)
    stand_in = Request(request.tokens[: compaction.end] + pass_ids, kv_offset=request.kv_offset)
    stand_in.blocks = BlockTable(request.blocks.block_ids + borrowed)
    stand_in.region, stand_in.computed = request.region, compaction.end
    indices = torch.arange(start, start + len(pass_ids), device=device)
    prefix = torch.arange(request.reused, device=device)
    return ReconstructionPass(
        request,
        compaction,
        policy,
        stand_in,
        borrowed,
        stand_in.blocks.slots(prefix, block_size),
        stand_in.blocks.slots(indices, block_size),
        compaction.end,
    )
