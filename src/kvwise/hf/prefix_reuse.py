"""Prefix reuse for plain transformers `generate`: compute a prompt's KV once, reuse it after.

    reuse = PrefixReuse(model, tenant="alice", tiers=[HostTier(2 << 30), DiskTier("/var/kvwise")])
    output = reuse.generate(input_ids, max_new_tokens=32, do_sample=False)

For a prompt, the longest cached run of full blocks is found in the device pool, then block by
block in the tiers (host, disk, Redis, in the order given); blocks found below are promoted to
the device. Only the rest of the prompt is computed. After generation the prompt's new full
blocks are stored. A block evicted from the device pool is written to every tier (write-through
at eviction). A tier that is down, full or returns a corrupt block simply misses: the block is
recomputed. Greedy outputs are the same with and without reuse. `prefetch(input_ids)` pulls a
prompt's blocks from the slow tiers into host RAM in the background while the request waits.

Device blocks hold [block_size, num_kv_heads, head_dim] per layer in `PagedKVStorage`, zeroed
when freed. Keys chain the block's tokens, the model, the tenant and the KV dtype.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from transformers import DynamicCache

from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import Namespace
from kvwise.core.radix import RadixCache
from kvwise.hf.geometry import kv_geometry, paged_storage_for
from kvwise.tiers.base import Tier
from kvwise.tiers.prefix_tiers import PrefixTiers, ReuseStats
from kvwise.util.secret_keys import namespace_key as default_namespace_key

__all__ = ["PrefixReuse", "ReuseStats"]


class PrefixReuse:
    """Args:
    model: a transformers causal LM (full-attention layers).
    tenant: whose prefixes these are; another tenant never sees them.
    shared: use the opt-in shared namespace (public system prompts) instead of the tenant's.
    block_size: tokens per block.
    device_blocks: blocks in the device pool (preallocated on the model's device).
    tiers: lower tiers, searched in order.
    namespace_key: the secret that keys block identities (default: the key file under
        $KVWISE_HOME/secrets, shared with the server's default).
    """

    def __init__(
        self,
        model,
        tenant: str = "default",
        shared: bool = False,
        block_size: int = 16,
        device_blocks: int = 256,
        tiers: list[Tier] | tuple[Tier, ...] = (),
        eviction: str = "lru",
        namespace_key: bytes | None = None,
    ):
        shape = kv_geometry(model)
        self.model, self.block_size, self.num_layers = model, block_size, shape.num_layers
        namespace = Namespace(shape.model_id, tenant, str(shape.dtype), default_namespace_key(namespace_key))
        self.namespace = namespace.shared() if shared else namespace
        self.pool = BlockPool(device_blocks, block_size)
        self.storage = paged_storage_for(model, device_blocks, block_size)
        self.storage.attach(self.pool)
        self.tree = RadixCache(self.pool, eviction=eviction)
        self.tiers = list(tiers)
        self.stats = ReuseStats()
        self.tiered = PrefixTiers(self.tiers, self.storage, self.pool, self.tree, self.stats)
        self.tree.on_evict = self.tiered.spill

    # ---- the one-call API ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """`model.generate` for one prompt [1, n], reusing and then storing its prefix KV."""
        cache, _ = self.prefill_cache(input_ids)
        output = self.model.generate(input_ids, cache=cache, **generate_kwargs)
        self.store(input_ids, cache)
        return output

    # ---- the two steps -------------------------------------------------------------------------
    def prefill_cache(self, input_ids: torch.Tensor) -> tuple[DynamicCache, int]:
        """A DynamicCache holding the longest reusable prefix of `input_ids`, and its length.

        At least the last prompt token is left to compute, so generation has logits to start from.
        """
        if input_ids.shape[0] != 1:
            raise ValueError(f"prefix reuse takes one prompt at a time, got a batch of {input_ids.shape[0]}")
        tokens = input_ids[0].tolist()
        usable_blocks = (len(tokens) - 1) // self.block_size
        self.stats.queries_tokens += usable_blocks * self.block_size
        match = self.tree.match_prefix(tokens[: usable_blocks * self.block_size], self.namespace)
        self.stats.hits_tokens["device"] += len(match.nodes) * self.block_size
        nodes = match.nodes + self.tiered.extend(tokens, self.namespace, match, usable_blocks)
        cache = DynamicCache(config=self.model.config)
        if nodes:
            table = torch.tensor([node.block for node in nodes], device=self.model.device)
            # every layer's blocks in one gather each: [layers, blocks, block_size, kv_heads, head_dim]
            all_keys, all_values = self.storage.all_keys[:, table], self.storage.all_values[:, table]
            for layer in range(self.num_layers):
                keys, values = all_keys[layer].flatten(0, 1), all_values[layer].flatten(0, 1)  # [tokens, heads, dim]
                cache.update(keys.transpose(0, 1)[None], values.transpose(0, 1)[None], layer)
        return cache, len(nodes) * self.block_size

    def store(self, input_ids: torch.Tensor, cache: DynamicCache) -> int:
        """Store the prompt's full blocks that are not cached yet; returns how many were added."""
        tokens = input_ids[0].tolist()
        full_blocks = min(len(tokens), cache.get_seq_length()) // self.block_size
        known = len(self.tree.match_prefix(tokens[: full_blocks * self.block_size], self.namespace).nodes)
        missing = full_blocks - known
        if missing <= 0 or not self._make_room(missing):
            return 0
        blocks = self.pool.allocate(missing)
        for index, block in enumerate(blocks):
            start = (known + index) * self.block_size
            self._write_block(block, cache, start)
        path = self.tree.insert(tokens[: full_blocks * self.block_size], [-1] * known + blocks, self.namespace)
        self.pool.release(blocks)  # the tree holds its own reference to the blocks it kept
        return max(0, len(path) - known)

    def report(self) -> dict:
        """Everything measured, for logs and metrics: lookups, hits per tier, hit rate, spill
        ratio, evictions, bytes held per tier (device included), corrupt entries, tier errors."""
        block_bytes = self.storage.block_bytes
        return {
            "queries_tokens": self.stats.queries_tokens,
            "hits_tokens": dict(self.stats.hits_tokens),
            "hit_rate": self.stats.hit_rate,
            "spill_ratio": self.stats.spill_ratio,
            "evictions": self.stats.evictions,
            "recomputed_blocks": self.stats.recomputed_blocks,
            "bytes_held": {"device": self.pool.stats().used * block_bytes}
            | {tier.name: tier.stats.bytes_held for tier in self.tiers},
            "corrupt": {tier.name: tier.stats.corrupt for tier in self.tiers},
            "errors": {tier.name: tier.stats.errors for tier in self.tiers},
        }

    def prefetch(self, input_ids: torch.Tensor) -> Future:
        """Start pulling the blocks of `input_ids`' cached prefix that sit in slow tiers (disk,
        Redis) up into the first tier (host RAM), in a background thread, so the request's
        `prefill_cache` finds them there. Returns a Future of the number of blocks moved."""
        return self.tiered.prefetch(input_ids[0].tolist(), self.namespace)

    # ---- internals -------------------------------------------------------------------------------
    def _make_room(self, count: int) -> bool:
        if not self.pool.can_allocate(count):
            self.tree.evict(count - self.pool.num_free)
        return self.pool.can_allocate(count)

    def _write_block(self, block: int, cache: DynamicCache, start: int) -> None:
        slots = torch.arange(block * self.block_size, (block + 1) * self.block_size, device=self.model.device)
        for layer in range(self.num_layers):
            layer_cache = cache.layers[layer]
            keys = layer_cache.keys[0, :, start : start + self.block_size].transpose(0, 1)
            values = layer_cache.values[0, :, start : start + self.block_size].transpose(0, 1)
            self.storage.write(layer, slots, keys, values)
