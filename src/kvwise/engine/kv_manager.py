"""`KVCacheManager`: the one owner of the engine's KV memory.

It holds the block pool, the paged storage, the radix tree (prefix cache), the prefix tiers, host
swap and the quantized pools, and it is the only writer of requests' block tables. The scheduler
decides who runs; it asks here first and then acts, in the way of vLLM v1's KVCacheManager and
nano-vllm's block manager, so nothing fails halfway:

    match(request)                      take the prompt's cached prefix (device, then the tiers), or
                                        its document compressed once (compressed prefixes)
    can_allocate / allocate(request, tokens)   blocks for the request's first `tokens` tokens
    free(request)                       give everything back (device, quantized, host copy, locks)
    cache_prompt(request, upto)         publish its computed full blocks to the prefix cache
    can_swap_out / swap_out, can_swap_in / swap_in      preemption to host memory and back
    plan_compactions(chunks), apply_compaction(request, compaction)   per-request eviction into
                                        head pages (each KV head keeps its own tokens)
    can_borrow, finish_reconstruction   KVzip's reconstruction pass: its blocks, then its result
    quantize_settled(requests)          per-request kv_quant of settled private blocks
    stats() -> KVStats                  what the metrics and benches report

Cached prefixes are reclaimable memory: `can_allocate` evicts unlocked ones (to the tiers, when
there are tiers), then compressed documents no request reads, before it answers, as vLLM reuses
free cached blocks. It never touches a running request: preempting one is the scheduler's
decision.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future
from types import MappingProxyType

import torch

from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import SegmentedNamespace, compressed_key
from kvwise.core.radix import RadixCache
from kvwise.engine import kv_control
from kvwise.engine.block_table import BlockTable, Place
from kvwise.engine.compaction import Compaction, PrivateKV, kept_score
from kvwise.engine.compressed_payload import read_entry, write_entry
from kvwise.engine.compressed_prefixes import CompressedEntry, CompressedPrefixes
from kvwise.engine.config import CacheConfig
from kvwise.engine.head_pages import HeadPages
from kvwise.engine.head_region import HeadRegion
from kvwise.engine.kv_actions import Action, Outcome
from kvwise.engine.kv_settings import KVSettings
from kvwise.engine.kv_stats import KVStats, TierUsage
from kvwise.engine.kv_view import ControllerView, RoutingSnapshot, RunnerView
from kvwise.engine.namespaces import default_namespace
from kvwise.engine.quant_pages import QuantPages
from kvwise.engine.quant_pool import QuantPool
from kvwise.engine.request import Request
from kvwise.engine.settled_region import KeptRows, settle_layer
from kvwise.engine.swap import HostSwap
from kvwise.kv.paged import PagedKVStorage
from kvwise.kv.quantizer import Quantizer
from kvwise.kv.stored_form import into_pages
from kvwise.tiers.base import Tier
from kvwise.tiers.prefix_tiers import PrefixTiers, ReuseStats

log = logging.getLogger("kvwise.engine")

PLENTY_FREE_FRACTION = 0.25  # whole-request reservations stop when fewer blocks than this stay free


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        tree: RadixCache | None = None,
        namespace_of=None,
        storage: PagedKVStorage | None = None,
        swap: HostSwap | None = None,
        tiers: PrefixTiers | None = None,
    ):
        """namespace_of(request) -> Namespace: a request's block identity (default: one model "m").
        Without storage the manager is bookkeeping only (scheduler tests); quantization, swap and
        tiers need it."""
        self._pool, self._tree, self._storage, self._swap, self._tiers = pool, tree, storage, swap, tiers
        self.namespace_of = namespace_of if namespace_of is not None else default_namespace("m")
        self.block_size = pool.block_size
        self._quant_pools: dict[str, QuantPool] = {}  # per quantizer spec, made when first asked for
        self._head_pages = HeadPages(pool, storage) if storage is not None else None
        self._quantized_pages: dict[str, QuantPages] = {}  # per quantizer spec: evicted requests' regions
        # documents compressed once and reused (with the prefix cache: both are reuse across requests)
        self._compressed = CompressedPrefixes() if tree is not None and storage is not None else None
        self.rotate_queries = None  # the model's query rotation, for scorers that move queries (KVzip self)
        self.prefix_stats = tiers.stats if tiers is not None else ReuseStats()  # tier hits, spills, time
        self.recomputed_blocks = 0
        self.peak_blocks = 0
        self.geometry = None  # the model's KVGeometry (heads, head size, windows), set by for_model
        self.attach_quantizer = lambda quantizer: quantizer  # for_model: the model's low-rank bases

    @classmethod
    def for_model(cls, model, config: CacheConfig, tiers: Sequence[Tier] = ()) -> KVCacheManager:
        """Pool, storage (on the model's device, in its dtype), tree, swap space and tiers for `model`."""
        from kvwise.hf.geometry import kv_geometry
        from kvwise.hf.rope import query_rotator

        if tiers and not config.prefix_caching:
            raise ValueError("prefix tiers hold evicted prefix-cache blocks: they need prefix_caching=True")
        shape = kv_geometry(model)
        pool = BlockPool(config.num_blocks, config.block_size)
        storage = PagedKVStorage(
            shape.num_layers,
            config.num_blocks,
            config.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
            model.device,
        )
        storage.attach(pool)
        tree = (
            RadixCache(pool, default_quota=config.prefix_quota_blocks, fair_share=config.fair_prefix_shares)
            if config.prefix_caching
            else None
        )
        prefix_tiers = PrefixTiers(tiers, storage, pool, tree, publish=config.publish_prefixes) if tiers else None
        if prefix_tiers is not None:
            tree.on_evict = prefix_tiers.spill
        swap = HostSwap(storage, config.swap_space_bytes) if config.swap_space_bytes else None
        namespace_of = default_namespace(shape.model_id, str(shape.dtype), b"", config.block_size)
        manager = cls(pool, tree, namespace_of, storage=storage, swap=swap, tiers=prefix_tiers)
        manager.geometry = shape
        manager.rotate_queries = query_rotator(model)
        manager.attach_quantizer = lambda quantizer: quantizer.attach(model)
        return manager

    @property
    def prefix_caching(self) -> bool:
        return self._tree is not None

    # ---- the door: what the rest of kvwise reads of KV memory and asks of it -----------------------
    @property
    def num_blocks(self) -> int:
        return self._pool.num_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of one device block, keys and values of every layer."""
        return self._storage.block_bytes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values over every layer, in the pool's dtype."""
        return self._storage.token_bytes

    @property
    def device(self) -> torch.device:
        return self._storage.keys[0].device

    @property
    def page_tokens(self) -> int:
        """Token slots of one head page (the unit an evicted request's region is stored in)."""
        return self._head_pages.page_tokens

    @property
    def has_tiers(self) -> bool:
        """Whether evicted prefix blocks go to lower tiers (else they are dropped)."""
        return self._tiers is not None

    @property
    def swapped_out_blocks(self) -> int:
        return self._swap.swapped_out_blocks if self._swap is not None else 0

    def usage(self) -> float:
        """Share of the device pool's blocks not free (prefix-cached blocks count as used)."""
        return 1 - self.free_blocks() / self._pool.num_blocks

    def assign_settings(self, request: Request, settings: KVSettings | None) -> None:
        """Give `request` its own KV settings (eviction, cap, quantizer): the one writer of
        `request.kv` after a request is made. Takes effect at its next compression point or, for a
        quantizer, at the next `quantize_settled`."""
        request.kv = settings

    def execute(self, action: Action) -> Outcome:
        """Carry out a controller's action (`kv_actions`); one that fails changes nothing."""
        return kv_control.execute(self, action)

    def controller_view(
        self, running=(), stalls: tuple[int, int] = (0, 0), outcomes=(), held_back=(), last_step=None, admitting=None
    ) -> ControllerView:
        """What a controller reads: memory, the scheduler's `stalls` (memory stalls, preemptions),
        the `running` requests, the outcomes of its last actions, the `held_back` (waiting)
        requests, the engine's `last_step` (`LastStep`) and, for an admission, the request
        `admitting`."""
        return kv_control.controller_view(self, running, stalls, outcomes, held_back, last_step, admitting)

    def quantization_errors(self) -> dict[str, tuple[float, float]]:
        """Per quantizer spec in use, the mean relative error of (keys, values) it measured."""
        pools = list(self._quant_pools.items())
        return {name: (quant.mean_error("keys"), quant.mean_error("values")) for name, quant in pools}

    def lend_blocks(self, count: int) -> list[int]:
        """`count` blocks for a KVzip reconstruction pass (check `can_borrow` first); they come back
        with `finish_reconstruction`, or with `free` when the pass is cut short."""
        return self._pool.allocate(count) if count else []

    def spill_cold_prefixes(self, wanted: int) -> int:
        """Evict up to `wanted` unlocked prefix-cache blocks, least recently used first (to the tiers
        when there are some); returns how many went."""
        return self._tree.evict(wanted) if self._tree is not None else 0

    def prefix_tiers(self) -> tuple[Tier, ...]:
        """The lower tiers under the prefix cache, fastest first (for re-keying them)."""
        return tuple(self._tiers.tiers) if self._tiers is not None else ()

    def routing_snapshot(self, published_limit: int) -> RoutingSnapshot:
        """Where this engine's prefix blocks are, for a router: block keys on the device and in the
        host tier, the last `published_limit` keys written to a shared tier, and seconds per block
        to restore from each tier."""
        device = list(self._tree.keys()) if self._tree is not None else []
        host, published, restore = [], [], {}
        if self._tiers is not None:
            host = [key for tier in self._tiers.tiers if tier.name == "host" for key in tier.keys()]
            if self._tiers.publisher is not None:
                published = list(self._tiers.publisher.recent_keys(published_limit))
            restore = self._tiers.restore_seconds_per_block()
        return RoutingSnapshot(device, host, published, restore)

    def runner_view(self) -> RunnerView:
        """What the model runner reads: the paged storage and the quantized pools, read-only (a pool
        made later shows up in the view)."""
        return RunnerView(self._storage, MappingProxyType(self._quant_pools))

    def compressed_entries(self) -> list[CompressedEntry]:
        """The documents compressed once and held for reuse, for reports."""
        return list(self._compressed.entries.values()) if self._compressed is not None else []

    def prefix_cache_holdings(self) -> tuple[int, int]:
        """(blocks the prefix cache holds, locks on them): both 0 once every request is done and
        nothing leaked."""
        if self._tree is None:
            return 0, 0
        return len(self._tree), sum(node.locks for node in self._tree.nodes())

    def set_namespace_keys(self, keys: Sequence[bytes]) -> None:
        """New requests' blocks are keyed with keys[0]; blocks the tiers hold under the others still
        come back (keyed anew on the device)."""
        self.namespace_of.rekey(keys[0])
        if self._tiers is not None:
            self._tiers.retired_secrets = tuple(keys[1:])

    # ---- the prefix cache ------------------------------------------------------------------------
    def cached_length(self, request: Request, tiers: bool = False) -> int:
        """Prompt tokens cached on the device for `request`, and with `tiers` those the tiers hold
        after them (a peek: nothing is touched or moved)."""
        if self._tree is None:
            return 0
        namespace = self.namespace_of(request)
        match = self._tree.match_prefix(request.prompt[:-1], namespace, touch=False)
        if not tiers or self._tiers is None:
            return match.length
        usable = (len(request.prompt) - 1) // self.block_size
        held = self._tiers.held_blocks(request.prompt, namespace, len(match.nodes), usable)
        return match.length + held * self.block_size

    def match(self, request: Request) -> int:
        """Take the prompt's cached prefix: the device match continued in the tiers, locked for the
        request and first in its block table. Returns the tokens it covers (at least the last
        prompt token is left to compute)."""
        if self._tree is None or request.prompt_logprobs is not None:
            return 0  # a scored prompt is computed whole: cached tokens have no logits to give
        namespace = self.namespace_of(request)
        hit = self._match_compressed(request, namespace)
        if hit:
            return hit
        match = self._tree.match_prefix(request.prompt[:-1], namespace)
        usable = (len(request.prompt) - 1) // self.block_size
        if self._tiers is not None and self._tiers.extend(request.prompt, namespace, match, usable):
            match = self._tree.match_prefix(request.prompt[:-1], namespace)
        self._tree.lock(match.nodes)
        self._pool.incref(match.blocks)
        request.locked_nodes, request.blocks = match.nodes, BlockTable(match.blocks)
        request.reused = match.length
        return match.length

    # ---- documents compressed once ------------------------------------------------------------------
    def _compressed_key(self, request: Request, namespace=None) -> bytes:
        namespace = namespace if namespace is not None else self.namespace_of(request)
        own = namespace.own if isinstance(namespace, SegmentedNamespace) else namespace  # never the shared one
        return compressed_key(own, request.kv.spec, request.prompt[: request.compress_upto])

    def _match_compressed(self, request: Request, namespace) -> int:
        """Take a published compressed document for `request` (its region, read-only, and the
        prefix blocks it was compressed after). Returns the tokens it covers, 0 on a miss."""
        if self._compressed is None or request.compress_upto is None or request.kv is None:
            return 0
        upto = request.compress_upto
        if upto >= len(request.prompt):  # nothing would be left to compute the first token with
            return 0
        key = self._compressed_key(request, namespace)
        entry = self._compressed.get(key, request.prompt[:upto])
        if entry is None and self._tiers is not None:
            entry = self._restore_compressed(key, request)
        if entry is None:
            return 0
        match = self._tree.match_prefix(request.prompt[: entry.reused], namespace)
        if match.length < entry.reused:  # its prefix blocks are gone: compute it again
            return 0
        self._tree.lock(match.nodes)
        self._pool.incref(match.blocks)
        request.locked_nodes, request.blocks = match.nodes, BlockTable(match.blocks)
        request.reused, request.kv_offset = entry.reused, upto - entry.reused
        request.region, entry.region.holders = entry.region, entry.region.holders + 1
        request.kv_stats = list(entry.stats) if entry.stats is not None else None
        request.compressed_kv_bytes = self.request_bytes(request)
        request.compressed_hit = True
        self._compressed.record_hit(entry)
        return upto

    def _publish_compressed(self, request: Request) -> None:
        """After a query-agnostic compression of a whole document: publish its region."""
        entry = CompressedEntry(
            tuple(request.prompt[: request.compress_upto]), request.reused, request.region, request.kv_stats
        )
        replaced = self._compressed.put(self._compressed_key(request), entry)
        if replaced is not None and replaced.region is not entry.region:
            self._let_go(replaced.region)

    def _spill_compressed(self, key: bytes, entry: CompressedEntry) -> None:
        """Write a compressed document leaving the device to the prefix tiers."""
        blob = write_entry(entry.region, entry.tokens, entry.reused, entry.stats, self._storage)
        if self._tiers.store_blob(key, blob):
            self._compressed.spilled += 1

    def _restore_compressed(self, key: bytes, request: Request) -> CompressedEntry | None:
        """A compressed document brought back from the tiers into pages and published again, or
        None (absent, damaged, for other tokens, or no room)."""
        blob = self._tiers.fetch_blob(key)
        if blob is None:
            return None
        try:
            state = read_entry(blob)
            tokens = tuple(state["tokens"].tolist())
            if tokens != tuple(request.prompt[: request.compress_upto]):
                return None  # same key, other tokens: never served
            region = self._region_from_state(request, state)
        except (ValueError, KeyError, RuntimeError) as error:
            log.warning("a compressed document from the tiers could not be read back: %s", error)
            return None
        if region is None:
            return None
        names = [name.removeprefix("stats.") for name in state if name.startswith("stats.")]
        stats = None
        if names:
            stats = [
                {name: state[f"stats.{name}"][layer].to(self.device) for name in names}
                for layer in range(len(region.counts))
            ]
        entry = CompressedEntry(tokens, int(state["reused"][0]), region, stats)
        self._compressed.put(key, entry)
        region.holders -= 1  # the cache's reference only
        self._compressed.restored += 1
        return entry

    def _region_from_state(self, request: Request, state: dict) -> HeadRegion | None:
        """Pages for a document read from a tier: device pages, or quantized pages restored bit for bit."""
        device = self.device
        counts = state["counts"].tolist()
        positions = [
            layer.to(device)[:, : max(layer_counts, default=0)]
            for layer, layer_counts in zip(state["positions"], counts)
        ]
        valid = [layer >= 0 for layer in positions]
        if request.kv.quant is not None:
            stored = {name.removeprefix("quant."): t for name, t in state.items() if name.startswith("quant.")}
            store = self.quant_pages(request.kv.quantizer)
            sink_counts = self._sink_counts(counts, store.form)
            pages = _pages_needed(counts, sink_counts, store.page_tokens)
            ids = store.restore(stored, pages) if self._room_in(store, pages) else None
            if ids is None:
                return None
            dtype, per_layer = self._storage.keys[0].dtype, [sum(layer) for layer in sink_counts]
            sinks = tuple(
                list(state[f"sinks.{role}"].to(device, dtype).split(per_layer)) for role in ("keys", "values")
            )
            return self._quantized_region(store, ids, counts, valid, positions, sinks)
        per_page = self._head_pages.page_tokens
        pages = sum(-(-count // per_page) for layer in counts for count in layer)
        if not self._reclaim(self._head_pages.blocks_short(pages)):
            return None
        keys, values = state["keys"].to(device), state["values"].to(device)
        kept, start = [], 0
        for layer_counts, layer_positions in zip(counts, positions):
            rows = sum(layer_counts)
            layer_keys, layer_values = keys[start : start + rows], values[start : start + rows]
            kept.append(KeptRows(layer_counts, layer_keys, layer_values, layer_positions, {}, None))
            start += rows
        return self._write_region(request, kept)

    def _let_go(self, region: HeadRegion) -> None:
        """One holder fewer; the last one gives the pages back (zeroed)."""
        region.holders -= 1
        if region.holders == 0:
            store = region.quant if region.quant is not None else self._head_pages
            for heads in region.pages:
                store.release([page for pages in heads for page in pages])
            self._release_full_rows(region)
            region.zero_sinks()

    def _reclaim(self, blocks: int) -> bool:
        """Free `blocks` device blocks if it can be done without touching a running request:
        unlocked prefix-cache blocks first, then compressed documents nobody reads. True when the
        pool then has them."""
        if self._pool.can_allocate(blocks):
            return True
        if self._tree is not None:
            self._tree.evict(blocks - self._pool.num_free)
        while not self._pool.can_allocate(blocks) and self._evict_compressed():
            pass
        return self._pool.can_allocate(blocks)

    def _evict_compressed(self, store: QuantPages | None = None) -> bool:
        """Drop the least recently used compressed document nobody reads (with pages in `store`,
        when given), to the tiers first if there are tiers. False when there is none."""
        evicted = self._compressed.evict_one(store) if self._compressed is not None else None
        if evicted is None:
            return False
        key, entry = evicted
        if self._tiers is not None:
            self._spill_compressed(key, entry)
        self._let_go(entry.region)
        return True

    def _room_in(self, store: QuantPages, pages: int) -> bool:
        """Whether `store` can take `pages` quantized pages, after dropping documents held there."""
        while not store.ids.can_allocate(pages) and self._evict_compressed(store):
            pass
        return store.ids.can_allocate(pages)

    def prefetch(self, request: Request) -> Future | None:
        """Pull the prompt's cached blocks from slow tiers into the first one in the background
        (None without tiers); `match` then finds them there."""
        if self._tiers is None:
            return None
        return self._tiers.prefetch(request.prompt, self.namespace_of(request))

    def cache_prompt(self, request: Request, upto: int) -> None:
        """Publish the full blocks of the request's first `upto` tokens to the prefix cache (a
        request whose private blocks hold its own compressed state publishes nothing). A key that
        may only read the shared namespace caches nothing while its shared segment is not there."""
        if self._tree is None or _compresses(request):
            return
        tokens = request.tokens[: upto // self.block_size * self.block_size]
        namespace = self.namespace_of(request)
        segment = request.shared_prefix_tokens // self.block_size * self.block_size
        if segment and not request.may_publish_shared:
            if self._tree.match_prefix(tokens[:segment], namespace, touch=False).length < min(segment, len(tokens)):
                return
        self._tree.insert(tokens, request.blocks.block_ids, namespace, announce=True)

    # ---- blocks ------------------------------------------------------------------------------------
    def blocks_needed(self, request: Request, tokens: int) -> int:
        """Device blocks `request` lacks to hold its first `tokens` tokens."""
        return -(-(tokens - request.kv_offset) // self.block_size) - len(request.blocks)

    def can_allocate(self, request: Request, tokens: int) -> bool:
        """Whether `allocate(request, tokens)` will succeed, after evicting unlocked cached prefixes."""
        needed = self.blocks_needed(request, tokens)
        return needed <= 0 or self._reclaim(needed)

    def allocate(self, request: Request, tokens: int) -> None:
        """Blocks for the request's first `tokens` tokens (check `can_allocate` first).

        While memory is plentiful, a request's first allocation takes consecutive blocks for all
        its tokens (prompt + max_tokens): the CPU runner then reads its KV as one slice of the pool
        instead of gathering blocks every layer and step. Under pressure, or without a long enough
        free run, blocks come one step's need at a time."""
        needed = self.blocks_needed(request, tokens)
        if needed <= 0:
            return
        if not request.reserved:
            request.reserved = True
            total = -(-(len(request.prompt) + request.params.max_tokens) // self.block_size) - len(request.blocks)
            if self._pool.num_free - total >= self._pool.num_blocks * PLENTY_FREE_FRACTION:
                run = self._pool.allocate_contiguous(total)
                if run is not None:
                    request.blocks.append(run)
                    return
        request.blocks.append(self._pool.allocate(needed))

    def can_borrow(self, blocks: int) -> bool:
        """Whether `blocks` device blocks can be had for a moment (a context pass), after evicting
        unlocked cached prefixes."""
        return self._reclaim(blocks)

    def free_blocks(self) -> int:
        """Device blocks free now or as soon as asked for: the pool's free blocks and the prefix
        cache's blocks nobody else holds (what `_reclaim` would give back)."""
        return self._pool.num_free + (self._tree.reclaimable() if self._tree is not None else 0)

    def fit_tokens(self, request: Request) -> int:
        """The most tokens `request` can hold with its blocks and the free ones."""
        return (len(request.blocks) + self._pool.num_free) * self.block_size + request.kv_offset

    def free(self, request: Request, recompute: bool = False) -> None:
        """Give back everything the request holds: device and quantized blocks, its host copy, its
        prefix locks. recompute: its KV is dropped to be computed again (a preemption), so its
        layout after eviction goes too and the blocks count as recomputed."""
        if recompute:
            self.recomputed_blocks += len(request.blocks)
            request.kv_offset = 0
        self._release_region(request)
        if request.swapped is not None:
            self._swap.drop(request.swapped)
            request.swapped = None
        if request.reconstruction is not None:  # a pass cut short: its borrowed blocks go back
            self._pool.release(request.reconstruction.borrowed)
            request.reconstruction = None
        request.reserved = False
        if self._tree is not None and request.locked_nodes:
            self._tree.unlock(request.locked_nodes)
        self._release(request, request.blocks)
        request.blocks, request.locked_nodes = BlockTable(), []

    def _release(self, request: Request, table: BlockTable) -> None:
        """Device blocks back to the pool, quantized ones to the request's QuantPool (host entries
        are the swapped copy, dropped with it)."""
        device = table.ids(Place.DEVICE)
        if device:
            self._pool.release(device)
        quantized = table.ids(Place.QUANTIZED)
        if quantized:
            self._quant_pools[request.kv.quant].release(quantized)

    def _release_region(self, request: Request) -> None:
        """Its pages back (zeroed), with its running statistics."""
        if request.region is not None:
            self._let_go(request.region)
        request.region, request.kv_stats = None, None

    def request_bytes(self, request: Request) -> int:
        """The KV bytes `request` holds: its device blocks with computed tokens in them (a shared
        prefix included; blocks reserved ahead are not counted), head pages and quantized blocks."""
        table = request.blocks
        filled = table.places[: -(-(request.computed - request.kv_offset) // self.block_size)]
        held = filled.count(Place.DEVICE) * self._storage.block_bytes
        if request.region is not None:
            held += request.region.nbytes
        if filled.count(Place.QUANTIZED):
            held += filled.count(Place.QUANTIZED) * self._quant_pools[request.kv.quant].block_bytes
        return held

    # ---- host swap ---------------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        """A swap space with room for all of the request's blocks, all on the device (quantized
        blocks and head pages are recomputed instead)."""
        table = request.blocks
        return (
            self._swap is not None
            and bool(table)
            and request.region is None
            and request.reconstruction is None
            and table.all_in(Place.DEVICE)
            and self._swap.can_hold(len(table))
        )

    def swap_out(self, request: Request) -> bool:
        """Copy the request's KV to host memory and free its device blocks and locks; its table
        then points at the host copy. False (nothing changed) when host memory refused the copy."""
        try:  # copied before anything changes: a failed copy leaves no block or lock behind
            swapped = self._swap.swap_out(request.blocks.block_ids)
        except Exception:  # noqa: BLE001 - host memory refused: recompute instead
            log.exception("swapping out %s failed; it will be recomputed", request.request_id)
            return False
        length = len(request.blocks)
        self.free(request)
        request.swapped, request.reserved = swapped, True
        request.blocks = BlockTable(range(length), Place.HOST)
        return True

    def can_swap_in(self, request: Request) -> bool:
        """Device blocks for a swapped request's host copy, after evicting unlocked cached prefixes."""
        return self._reclaim(request.blocks.count(Place.HOST))

    def swap_in(self, request: Request) -> bool:
        """Copy a swapped request's KV back into fresh device blocks (check `can_swap_in` first).
        False when the copy failed: its blocks and host copy are given back and it is to be
        recomputed (its layout after eviction is gone)."""
        blocks = self._pool.allocate(request.blocks.count(Place.HOST))
        try:
            self._swap.swap_in(request.swapped, blocks)
        except Exception:  # noqa: BLE001 - give the blocks back and recompute it instead
            log.exception("swapping in %s failed; it will be recomputed", request.request_id)
            request.blocks = BlockTable(blocks)
            self.free(request, recompute=True)
            return False
        request.blocks, request.swapped = BlockTable(blocks), None
        return True

    # ---- per-request eviction ----------------------------------------------------------------------
    def plan_compactions(self, chunks) -> list[Compaction]:
        """The evictions to score in this step's forward, for requests whose KVSettings evict: the
        ratio once, when the chunk reaching its compression point is computed; the cap
        (max_tokens) whenever a head would hold a block more than it; and, for policies with
        running statistics under a cap, an observation every step (nothing evicted)."""
        plans = []
        for chunk in chunks:
            request, settings = chunk.request, chunk.request.kv
            if settings is None or not settings.evicts:
                continue
            region = request.region
            tail = chunk.end - request.kv_offset - request.reused  # private tokens in blocks after this chunk
            held = (region.longest() if region is not None else 0) + tail
            ratio_now = settings.ratio > 0 and chunk.end == request.compression_point
            cap = settings.max_tokens
            cap_now = cap is not None and (held > cap + self.block_size or (ratio_now and held > cap))
            # running statistics are observed every step under a cap; kvzap's (scores from each
            # chunk's hidden states) on every prefill chunk, as only that chunk's forward has them
            observe = bool(settings.scorer.stat_names) and (cap is not None or settings.scorer.needs_hidden_states)
            if not (ratio_now or cap_now or observe):
                continue
            windows = self.geometry.windows if self.geometry is not None else ()
            first_full = next((layer for layer, window in enumerate(windows) if window is None), 0)
            first_head = (region.counts[first_full][0] if region is not None else 0) + tail
            plans.append(
                Compaction(
                    request,
                    settings.scorer,
                    self._private(request, chunk.end),
                    chunk.end,
                    len(self._storage.keys),
                    ratio=settings.ratio,
                    ratio_tokens=first_head if ratio_now else None,
                    cap=cap if cap_now else None,
                    rotate_queries=self.rotate_queries,
                    windows=windows,
                    chunk=chunk,
                    fill=self._page_fill(settings.quantizer) if ratio_now else None,
                )
            )
        return plans

    def _page_fill(self, quantizer: Quantizer | None) -> tuple[int, int] | None:
        """(page_tokens, sinks) of the pages a quantized mix's kept tokens go to, or None."""
        if quantizer is None:
            return None
        form = self.quant_pages(quantizer).form
        return form.page_tokens(), form.sink_tokens

    def _private(self, request: Request, end: int) -> PrivateKV:
        """The request's private KV once the tokens before position `end` are computed."""
        device = self.device
        indices = torch.arange(request.reused, end - request.kv_offset, device=device)
        return PrivateKV(
            request.region,
            request.blocks.slots(indices, self.block_size),
            indices + request.kv_offset,
            self._head_pages.kv_heads,
            self._pool.num_blocks * self.block_size,
            request.kv_stats,
        )

    def apply_compaction(self, request: Request, compaction: Compaction) -> None:
        """After the forward (and any context pass): the kept tokens of each (layer, KV head) move
        to head pages, and the blocks and pages they came from go back (zeroed). Every private
        token is then in the region; the tail starts empty at the end of the compaction."""
        if compaction.ratio_tokens is None and compaction.cap is None:  # an observation only
            # a sliding-window layer keeps its window and observes nothing
            request.kv_stats = [compaction.stats.get(layer, {}) for layer in range(compaction.num_layers)]
            return
        if request.reused % self.block_size:
            raise RuntimeError("a shared prefix must end on a block boundary to evict after it")
        masks = compaction.kept()
        fraction = kept_score(compaction, masks)  # evictions compound: what the last kept of what was left
        if fraction is not None:
            request.kept_score = fraction * (request.kept_score if request.kept_score is not None else 1.0)
        kept = [self._gather_kept(compaction, layer, mask) for layer, mask in enumerate(masks)]
        fresh = request.region is None
        # quantized rows it keeps stay in their pages (never quantized twice): the previous region
        # holds them until the new one does
        previous = compaction.private.region  # the region the kept rows' slots index
        if previous is not None and previous.quant is None:
            previous = None
        if previous is not None:
            previous.holders += 1
        try:
            self._release_region(request)
            if previous is not None and previous.holders == 1:
                # only this compaction holds it: its full rows go now (the kept rows are copies),
                # so the new region's take no more pages than these and the tail give back
                self._release_full_rows(previous)
            self._release(request, request.blocks.cut(request.reused // self.block_size))
            frozen = compaction.ratio_tokens is not None
            # a cap while the ratio's compression is still ahead: evict, then quantize what the
            # ratio keeps, as the library does (nothing settles before it)
            ratio_pending = not frozen and request.kv.ratio > 0 and compaction.end < request.compression_point
            request.region = self._write_region(request, kept, previous, frozen, quantize=not ratio_pending)
        finally:
            if previous is not None:
                self._let_go(previous)
        request.kv_stats = [layer.stats for layer in kept] if request.kv.scorer.stat_names else None
        request.kv_offset = compaction.end - request.reused
        if compaction.ratio_tokens is not None:
            request.compressed_kv_bytes = self.request_bytes(request)
            whole_document = request.compress_upto is not None and compaction.end == request.compress_upto
            if self._compressed is not None and whole_document and fresh:
                self._publish_compressed(request)

    def finish_reconstruction(self, request: Request) -> None:
        """A KVzip pass's last chunk ran: apply its compaction and give its borrowed blocks back."""
        reconstruction, request.reconstruction = request.reconstruction, None
        try:
            self.apply_compaction(request, reconstruction.compaction)
        finally:
            self._pool.release(reconstruction.borrowed)

    def _gather_kept(self, compaction: Compaction, layer: int, keep: torch.Tensor) -> KeptRows:
        """One layer's kept tokens (slots index the private rows: the region's, then the tail's)."""
        valid, positions = compaction.private.layer(layer)
        keys, values = compaction.private.read(self._storage, layer)  # [kv_heads, S, head_dim]
        keep = keep & valid
        counts = keep.sum(dim=-1)  # [kv_heads]
        # kept rows first, each head's in their original order: True sorts first under a stable sort
        order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[:, : int(counts.max())]
        rows = torch.arange(order.shape[1], device=order.device)[None, :] < counts[:, None]
        index = order[..., None].expand(-1, -1, keys.shape[-1])
        keys, values = keys.gather(1, index)[rows], values.gather(1, index)[rows]
        stats = {name: stat.gather(1, order) * rows for name, stat in compaction.stats.get(layer, {}).items()}
        positions = positions.gather(1, order).masked_fill(~rows, -1)
        return KeptRows(counts.tolist(), keys, values, positions, stats, order.masked_fill(~rows, -1))

    def _write_region(
        self,
        request: Request,
        kept: list[KeptRows],
        previous: HeadRegion | None = None,
        frozen: bool = True,
        quantize: bool = True,
    ) -> HeadRegion:
        """Pages for the kept tokens: quantized ones when the request asked for kv_quant (device
        head pages when the quantized store is full, or with quantize=False), else device head
        pages. previous: the quantized region the kept rows were gathered from, if any; frozen: the
        compaction ends a context's compression (everything but the sinks is quantized), else it
        caps a decoding request (the newest tokens stay in the model's dtype, as the stored form's
        residual)."""
        counts = [layer.counts for layer in kept]
        positions = [layer.positions for layer in kept]
        valid = [positions >= 0 for positions in positions]
        if request.kv.quant is not None and quantize:
            store = self.quant_pages(request.kv.quantizer)
            same_store = previous if previous is not None and previous.quant is store else None
            if same_store is not None or not frozen:
                region = self._write_settled(store, kept, same_store, frozen)
            else:
                region = self._write_quantized(request.kv.quantizer, kept, counts, valid, positions)
            if region is not None:
                return region
        per_page = self._head_pages.page_tokens
        needed = sum(-(-count // per_page) for layer_counts in counts for count in layer_counts)
        self._make_room_for_pages(needed, "a compacted region")
        pages, cells = [], []
        for layer_counts, keys, values, *_ in kept:
            layer_pages, layer_cells, _ = self._head_pages.write(layer_counts, keys, values)
            pages.append(layer_pages)
            cells.append(layer_cells)
        return HeadRegion(pages, counts, valid, positions, cells=cells, page_bytes=self._head_pages.page_bytes)

    def _write_quantized(
        self, quantizer: Quantizer, kept: list[KeptRows], counts, valid, positions
    ) -> HeadRegion | None:
        """The kept rows in the mix's stored form: each head's sinks in the model's dtype, the
        rest in quantized pages. None when the store is full."""
        store, ids, sinks = self.quant_pages(quantizer), [], ([], [])
        sink_counts = self._sink_counts(counts, store.form)
        self._room_in(store, _pages_needed(counts, sink_counts, store.page_tokens))
        for layer, (layer_counts, keys, values, *_) in enumerate(kept):
            sink_keys, page_keys, quantized = _split_sinks(keys, layer_counts, sink_counts[layer])
            sink_values, page_values, _ = _split_sinks(values, layer_counts, sink_counts[layer])
            pages_per_head = torch.tensor([-(-count // store.page_tokens) for count in quantized])
            heads = torch.repeat_interleave(torch.arange(len(layer_counts)), pages_per_head)
            pages = (into_pages(part, quantized, store.page_tokens) for part in (page_keys, page_values))
            stored = store.store(*pages, layer=layer, heads=heads)
            if stored is None:  # full: what this call stored goes back, and device pages take the region
                store.release(ids)
                return None
            ids += stored
            sinks[0].append(sink_keys.clone())
            sinks[1].append(sink_values.clone())
        return self._quantized_region(store, ids, counts, valid, positions, sinks)

    def _write_settled(
        self, store: QuantPages, kept: list[KeptRows], previous: HeadRegion | None, frozen: bool
    ) -> HeadRegion | None:
        """The kept rows in the stored form, quantized rows left as they are (as the library's
        cache drops rows and never quantizes one twice): a row the previous region held in a page
        keeps its codes there, and the page stays while it keeps any row; rows in the model's
        dtype stay so while they are sinks or in the residual window; only rows that settle now
        (`StoredForm.settling`, or all but the sinks when frozen) are quantized, into new pages.
        A page keeps its size when it loses rows, so a capped request can hold more pages than
        its tokens fill. None when the store is full."""
        windows = self.geometry.windows if self.geometry is not None else ()
        plans = [
            settle_layer(layer, entry, previous, store.form, frozen, bool(windows and windows[layer]))
            for layer, entry in enumerate(kept)
        ]
        if not self._room_in(store, sum(plan.new_pages for plan in plans)):
            return None
        if not frozen:
            self._make_room_for_full_rows(plans)
        ids: list[int] = []
        full_pages: list[int] = []
        full_cells: list[torch.Tensor] = []
        try:
            for layer, plan in enumerate(plans):
                stored = store.store(plan.settling_keys, plan.settling_values, layer=layer, heads=plan.settling_heads)
                if stored is None:  # full: what this call stored goes back, and device pages take the region
                    store.release(ids)
                    return None
                ids += stored
            device, new_ids = self.device, iter(ids)
            pages, page_ids, rows = [], [], []
            for plan in plans:
                layer_pages = [old + [next(new_ids) for _ in range(new)] for old, new in plan.head_pages]
                pages.append(layer_pages)
                flat = [page for head in layer_pages for page in head]
                page_ids.append(torch.tensor(flat, dtype=torch.long, device=device))
                rows.append(plan.rows)
                if not frozen:  # the full rows in the pool's head pages, where its blocks count them
                    written = self._head_pages.write(plan.full_counts, plan.full_keys, plan.full_values)
                    layer_full, cells, valid = written
                    full_pages += [page for head in layer_full for page in head]
                    full_cells.append(cells[valid])
        except BaseException:  # nothing stored here may outlive the failure unreleased (and unzeroed)
            store.release(ids)
            self._head_pages.release(full_pages)
            raise
        # last, once nothing can fail: the previous region lets go of them after this
        store.ids.incref([page for plan in plans for page in plan.old_pages])
        counts = [layer.counts for layer in kept]
        positions = [layer.positions for layer in kept]
        return HeadRegion(
            pages,
            counts,
            [layer >= 0 for layer in positions],
            positions,
            quant=store,
            page_ids=page_ids,
            rows=rows,
            sink_keys=[plan.full_keys for plan in plans] if frozen else None,
            sink_values=[plan.full_values for plan in plans] if frozen else None,
            full_cells=None if frozen else full_cells,
            full_pages=full_pages,
            full_page_bytes=self._head_pages.page_bytes,
            page_bytes=store.page_bytes,
        )

    def _make_room_for_full_rows(self, plans) -> None:
        """Free device blocks for the head pages of the plans' full rows."""
        per_page = self._head_pages.page_tokens
        wanted = sum(-(-count // per_page) for plan in plans for count in plan.full_counts)
        self._make_room_for_pages(wanted, "the rows a capped request keeps in full precision")

    def _make_room_for_pages(self, pages: int, what: str) -> None:
        """Free device blocks for `pages` more head pages (unlocked cached prefixes and documents
        go first); RuntimeError when the pool has no room for them."""
        if not self._reclaim(self._head_pages.blocks_short(pages)):
            raise RuntimeError(
                f"no room in the pool for {pages} head pages of {what} ({self._pool.num_free} blocks free)"
            )

    def _release_full_rows(self, region: HeadRegion) -> None:
        self._head_pages.release(region.full_pages)
        region.full_pages = []

    def _sink_counts(self, counts: list[list[int]], form) -> list[list[int]]:
        """[layer][head]: the rows a quantized region keeps in the model's dtype: the form's sinks,
        and all of a sliding-window layer's window, which the library's cache (transformers'
        sliding layers) never quantizes either."""
        windows = self.geometry.windows if self.geometry is not None else ()
        return [
            list(layer_counts) if windows and windows[layer] else [form.sinks(count) for count in layer_counts]
            for layer, layer_counts in enumerate(counts)
        ]

    def _quantized_region(self, store: QuantPages, ids: list[int], counts, valid, positions, sinks) -> HeadRegion:
        """The region whose pages are `ids` of `store`, layer by layer and head by head, and whose
        rows kept in the model's dtype are `sinks` (keys, values: [layer] -> [rows, head_dim])."""
        pages, page_ids, rows, start = [], [], [], 0
        device = self.device
        per_page, sink_counts = store.page_tokens, self._sink_counts(counts, store.form)
        for layer_counts, layer_sinks in zip(counts, sink_counts):
            per_head, first = [], start
            for count, sink in zip(layer_counts, layer_sinks):
                used = -(-(count - sink) // per_page)
                per_head.append(ids[start : start + used])
                start += used
            pages.append(per_head)
            page_ids.append(torch.tensor(ids[first:start], dtype=torch.long, device=device))
            rows.append(_page_rows(layer_counts, layer_sinks, per_page, device))
        return HeadRegion(
            pages,
            counts,
            valid,
            positions,
            quant=store,
            page_ids=page_ids,
            rows=rows,
            sink_keys=sinks[0],
            sink_values=sinks[1],
            page_bytes=store.page_bytes,
        )

    # ---- per-request quantization ------------------------------------------------------------------
    def quant_pages(self, quantizer: Quantizer) -> QuantPages:
        """The quantized page store of `quantizer` (one per spec, made when first asked for): room
        for a quarter of the pool's head pages, quantized."""
        if quantizer.spec not in self._quantized_pages:
            layers, heads = len(self._storage.keys), self._head_pages.kv_heads
            tokens = self._pool.num_blocks * self.block_size * layers * heads // 4
            pages = QuantPages(self.attach_quantizer(quantizer), self._storage, tokens)
            self._quantized_pages[quantizer.spec] = pages
        return self._quantized_pages[quantizer.spec]

    def quant_pool(self, quantizer: Quantizer) -> QuantPool:
        """The pool of blocks quantized with `quantizer` (one per spec, made when first asked for)."""
        if quantizer.spec not in self._quant_pools:
            pool = QuantPool(self.attach_quantizer(quantizer), self._storage, self._pool.num_blocks)
            self._quant_pools[quantizer.spec] = pool
        return self._quant_pools[quantizer.spec]

    def quantize_settled(self, requests: Sequence[Request]) -> list[tuple[Request, Exception]]:
        """Move requests' full private blocks outside the residual window to their QuantPool.
        Returns [(request, error)] for requests whose quantization raised (the others go on)."""
        failed = []
        for request in list(requests):
            if request.kv is None or request.kv.quant is None or request.computed < request.compression_point:
                continue  # its blocks settle once what it compresses is computed (with compress_upto, before the rest)
            if request.kv.max_tokens is not None:
                continue  # its tail is read again by the next eviction
            if _eviction_pending(request):
                continue  # evict first, then quantize what is kept: the eviction reads these blocks
            try:
                self._quantize(request)
            except Exception as error:  # noqa: BLE001 - that request alone fails
                failed.append((request, error))
        return failed

    def _quantize(self, request: Request) -> None:
        quant, table = self.quant_pool(request.kv.quantizer), request.blocks
        first = max(request.reused // self.block_size, 1)  # the shared prefix and the sink block stay
        full = (request.computed - request.kv_offset) // self.block_size
        settled = [i for i in range(first, full - quant.residual_blocks) if table.places[i] is Place.DEVICE]
        if not settled:
            return
        device = [table.block_ids[i] for i in settled]
        ids = quant.store(self._storage, device)
        if ids is None:
            return  # the quantized pool is full: the blocks stay as they are
        self._pool.release(device)
        for index, quantized in zip(settled, ids):
            table.move(index, Place.QUANTIZED, quantized)

    # ---- reports -----------------------------------------------------------------------------------
    def record_peak(self) -> None:
        self.peak_blocks = max(self.peak_blocks, self._pool.stats().used)

    def stats(self) -> KVStats:
        """Read from the engine thread or, for metrics, from another (reads of ints)."""
        pool = self._pool.stats()
        block_bytes = self._storage.block_bytes if self._storage is not None else 0
        quant_pools = list(self._quant_pools.items())
        tiers = self._tiers.tiers if self._tiers is not None else []
        publisher = self._tiers.publisher if self._tiers is not None else None
        return KVStats(
            block_bytes=block_bytes,
            num_blocks=pool.total,
            free_blocks=pool.free,
            used_blocks=pool.used,
            peak_used_blocks=self.peak_blocks,
            prefix_cached_blocks=len(self._tree) if self._tree is not None else 0,
            prefix_evictions=self._tree.evictions if self._tree is not None else 0,
            prefix_spilled_blocks=self.prefix_stats.spilled_blocks,
            quantized_bytes=sum(quant.used_bytes() for _, quant in quant_pools)
            + sum(store.used_bytes() for store in list(self._quantized_pages.values())),
            head_page_bytes=self._head_pages.used_pages * self._head_pages.page_bytes if self._head_pages else 0,
            head_page_blocks=self._head_pages.held_blocks if self._head_pages else 0,
            compressed_documents=len(self._compressed) if self._compressed is not None else 0,
            compressed_hits=self._compressed.hits if self._compressed is not None else 0,
            compressed_spilled=self._compressed.spilled if self._compressed is not None else 0,
            quantization_errors=self.quantization_errors(),
            swap_used_bytes=self._swap.used_bytes if self._swap is not None else None,
            swap_capacity_bytes=self._swap.capacity_bytes if self._swap is not None else None,
            swapped_out_blocks=self._swap.swapped_out_blocks if self._swap is not None else 0,
            swapped_in_blocks=self._swap.swapped_in_blocks if self._swap is not None else 0,
            recomputed_blocks=self.recomputed_blocks,
            tiers=tuple(
                TierUsage(
                    tier.name,
                    tier.stats.bytes_held,
                    getattr(tier, "capacity_bytes", None),
                    self.prefix_stats.hits_tokens[tier.name],
                    tier.stats.corrupt,
                    tier.stats.errors,
                    getattr(tier, "available", True),
                    publisher.published if publisher is not None and tier.shared else 0,
                )
                for tier in tiers
            ),
        )


def _compresses(request: Request) -> bool:
    """Its private blocks hold its own compressed state: never cache them as the prompt's."""
    return request.kv is not None and request.kv.active


def _eviction_pending(request: Request) -> bool:
    """Its ratio has not evicted yet: a KVzip reconstruction pass still reads its private blocks,
    or its compression point is not reached (they stay in the pool until the eviction ran)."""
    settings = request.kv
    awaiting_ratio = settings.evicts and settings.ratio > 0 and request.region is None and not request.compressed_hit
    return request.reconstruction is not None or awaiting_ratio


def _pages_needed(counts: list[list[int]], sink_counts: list[list[int]], per_page: int) -> int:
    """Quantized pages for a region keeping counts[layer][head] tokens, sink_counts of them unquantized."""
    return sum(
        -(-(count - sink) // per_page)
        for layer_counts, layer_sinks in zip(counts, sink_counts)
        for count, sink in zip(layer_counts, layer_sinks)
    )


def _split_sinks(rows: torch.Tensor, counts: list[int], sinks: list[int]):
    """rows [sum(counts), dim], head after head -> (the first sinks[h] rows of each head, the
    rest, the rest's count per head), both head after head."""
    first = torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    start = 0
    for count, sink in zip(counts, sinks):
        first[start : start + sink] = True
        start += count
    return rows[first], rows[~first], [count - sink for count, sink in zip(counts, sinks)]


def _page_rows(counts: list[int], sinks: list[int], per_page: int, device) -> torch.Tensor:
    """[kv_heads, most kept]: row of each head's token in [its layer's sinks, then its restored
    pages], both laid head after head (0 in padding)."""
    width = max(counts, default=0)
    rows = torch.zeros(len(counts), width, dtype=torch.long, device=device)
    sink_start, page_start = 0, sum(sinks)
    for head, (count, sink) in enumerate(zip(counts, sinks)):
        rows[head, :sink] = torch.arange(sink_start, sink_start + sink, device=device)
        rows[head, sink:count] = torch.arange(page_start, page_start + count - sink, device=device)
        sink_start += sink
        page_start += -(-(count - sink) // per_page) * per_page
    return rows
