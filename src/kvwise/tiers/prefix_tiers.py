"""`PrefixTiers`: the tiers under a device prefix cache (a `RadixCache` over a paged pool).

    tiers = PrefixTiers([HostTier(2 << 30), DiskTier("/var/kvwise")], storage, pool, tree)
    tree.on_evict = tiers.spill          # write-through at eviction, before the block is zeroed
    nodes = tiers.extend(tokens, namespace, match, usable_blocks=n)   # lock -> promote -> unlock
    future = tiers.prefetch(tokens, namespace)                          # slow tiers -> the first, in the background

With `publish=True`, blocks the tree takes as they are computed are also written to the shared
tiers (Redis) at once, off the engine's step (`tiers.publisher`), so other servers on the same
Redis find them before this one evicts them.

Shared by the library path (`hf.PrefixReuse`) and the engine (`engine.KVCacheManager`): a block
evicted from the device is written to every tier; a prompt whose cached prefix ends on the device
continues block by block in the tiers (host, then disk, then Redis, in the order given), and the
blocks found are copied into fresh device blocks and inserted in the tree. Room for them comes
only from free blocks and the prefix cache's own (promotion never preempts anyone). A tier that
is down, full or returns a corrupt block simply misses, and the block is recomputed.

A block on a tier is one tensor [num_layers, 2 (keys, values), block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import Namespace, chain_keys
from kvwise.core.radix import Match, Node, RadixCache
from kvwise.kv.paged import PagedKVStorage
from kvwise.tiers.base import Tier
from kvwise.tiers.publisher import SharedPublisher


@dataclass
class ReuseStats:
    """Token counts of lookups and where hits came from; spill and eviction volumes."""

    queries_tokens: int = 0
    hits_tokens: Counter = field(default_factory=Counter)  # tier name ("device", "host", ...) -> tokens
    evictions: int = 0
    evicted_bytes: int = 0
    spilled_bytes: int = 0
    spilled_blocks: int = 0  # evicted blocks at least one tier accepted
    recomputed_blocks: int = 0  # blocks a tier had but could not return (corrupt, down)
    seconds_in_tiers: float = 0.0  # wall time inside tier calls (the engine logs it per step)

    @property
    def hit_rate(self) -> float:
        return sum(self.hits_tokens.values()) / self.queries_tokens if self.queries_tokens else 0.0

    @property
    def spill_ratio(self) -> float:
        return self.spilled_bytes / self.evicted_bytes if self.evicted_bytes else 0.0


class PrefixTiers:
    def __init__(
        self,
        tiers: Sequence[Tier],
        storage: PagedKVStorage,
        pool: BlockPool,
        tree: RadixCache,
        stats: ReuseStats | None = None,
        publish: bool = False,
    ):
        self.tiers, self.storage, self.pool, self.tree = list(tiers), storage, pool, tree
        self.block_size = pool.block_size
        self.stats = stats if stats is not None else ReuseStats()
        # namespace secrets rotated out: blocks stored under them are still found (a rotation
        # would otherwise turn every tier cold at once) and come back under the current keys
        self.retired_secrets: tuple[bytes, ...] = ()
        self._prefetcher: ThreadPoolExecutor | None = None
        self.restore_seconds: Counter = Counter()  # tier name -> seconds spent fetching blocks found there
        self.restored_blocks: Counter = Counter()  # tier name -> blocks found there
        shared = [tier for tier in self.tiers if tier.shared]
        self.publisher = SharedPublisher(shared) if publish and shared else None
        if self.publisher is not None:
            tree.on_insert = self.publish

    def publish(self, node: Node) -> None:
        """Queue a just-computed block for the shared tiers (RadixCache.on_insert)."""
        self.publisher.offer(node.key, self.block_tensor(node.block))

    def spill(self, node: Node) -> None:
        """Write an evicted device block to every tier (RadixCache.on_evict: before it is zeroed);
        a shared tier is skipped for a block published there already."""
        data = self.block_tensor(node.block)
        self.stats.evictions += 1
        self.stats.evicted_bytes += data.nbytes
        published = self.publisher is not None and self.publisher.published_recently(node.key)
        accepted = [published and tier.shared or self._put(tier, node.key, data) for tier in self.tiers]
        if any(accepted):
            self.stats.spilled_bytes += data.nbytes
            self.stats.spilled_blocks += 1

    def extend(self, tokens: Sequence[int], namespace: Namespace, match: Match, usable_blocks: int) -> list[Node]:
        """Continue the device `match` of `tokens` in the tiers, up to `usable_blocks` blocks: its
        nodes are locked while room is made, so making room never evicts the prefix this continues.
        Returns the promoted nodes (the tree holds them; nothing is locked on return)."""
        if len(match.nodes) >= usable_blocks:
            return []
        self.tree.lock(match.nodes)
        try:
            return self.promote(tokens, namespace, len(match.nodes), usable_blocks)
        finally:
            self.tree.unlock(match.nodes)

    def promote(self, tokens: Sequence[int], namespace: Namespace, first: int, usable_blocks: int) -> list[Node]:
        """Blocks first.. of `tokens` fetched from the tiers until one misses, copied into device
        blocks and inserted in the tree (which holds them); returns their nodes. The caller locks
        the nodes before `first` (`extend` does). A tenant at its prefix quota gets no more than
        its headroom.

        Each tier is asked once for the whole run (Redis in one round trip), and what the host tier
        lends is copied straight into the device pool: one copy of the bytes, two calls per block.
        """
        headroom = self.tree.quota(namespace.tenant) - self.tree.usage[namespace.tenant]
        wanted = min(usable_blocks - first, headroom)
        if not self.tiers or wanted <= 0:
            return []
        prefix = tokens[: usable_blocks * self.block_size]
        keys = chain_keys(prefix, self.block_size, namespace)[first : first + int(wanted)]
        with ExitStack() as lent:
            found = self._find_run(keys, prefix, namespace, first, lent)
            if not found:
                return []
            # room is made while the host's entries are lent: the evictions below spill to the
            # tiers, which must not evict (and zero) what is about to be read
            count = self._room_for(len(found))
            if not count:
                return []
            blocks = self.pool.allocate(count)
            self.storage.write_entries(blocks, [block for _, block in found[:count]])
            for name, block in found:  # plaintext only this process held (decrypted) leaves no KV behind
                if self._decrypts(name):
                    block.zero_()
        end = (first + count) * self.block_size
        path = self.tree.insert(tokens[:end], [-1] * first + blocks, namespace)
        self.pool.release(blocks)  # the tree holds the blocks it kept
        promoted = path[first:]
        for (tier_name, _), _node in zip(found, promoted):
            self.stats.hits_tokens[tier_name] += self.block_size
        return promoted

    def held_blocks(self, tokens: Sequence[int], namespace: Namespace, first: int, usable_blocks: int) -> int:
        """Blocks first.. of `tokens` that some tier holds, up to the first that none does (a peek:
        nothing is read or moved)."""
        if not self.tiers or first >= usable_blocks:
            return 0
        keys = chain_keys(tokens[: usable_blocks * self.block_size], self.block_size, namespace)[first:]
        held = 0
        for key in keys:
            try:
                if not any(tier.exists(key) for tier in self.tiers):
                    break
            except Exception:  # a tier that cannot answer holds nothing, as on a read
                break
            held += 1
        return held

    def _find_run(self, keys: list[bytes], prefix, namespace: Namespace, first: int, lent: ExitStack) -> list:
        """[(tier name, block)] for keys[0..] up to the first that no tier has, each from the
        first tier that has it; blocks lent by a tier stay valid until `lent` closes."""
        found: list = [None] * len(keys)
        for tier in self.tiers:
            missing = [index for index, hit in enumerate(found) if hit is None]
            if not missing:
                break
            blocks = self._borrow(tier, [keys[index] for index in missing], lent)
            for index, block in zip(missing, blocks):
                if block is not None:
                    found[index] = (tier.name, block)
        run = next((index for index, hit in enumerate(found) if hit is None), len(found))
        if run < len(found) and self.retired_secrets:  # rotations are rare: block by block from here
            retired = [
                chain_keys(prefix, self.block_size, namespace.with_secret(secret)) for secret in self.retired_secrets
            ]
            while run < len(found):
                hit = next(filter(None, (self.fetch(chain[first + run]) for chain in retired)), None)
                if hit is None:
                    break
                found[run] = hit
                run += 1
        return found[:run]

    def _decrypts(self, tier_name: str) -> bool:
        """Whether blocks read from that tier were decrypted here (an unencrypted entry's bytes
        sit in the OS page cache or Redis anyway; zeroing our copy of them would hide nothing)."""
        return any(
            getattr(tier, "encrypted", False) and not tier.lends for tier in self.tiers if tier.name == tier_name
        )

    def _borrow(self, tier: Tier, keys: list[bytes], lent: ExitStack) -> list:
        """`tier.borrow(keys)` held open by `lent`; a block of another geometry is deleted (a
        checkpoint swapped in place); a tier that raises misses."""
        corrupt_before, errors_before = tier.stats.corrupt, tier.stats.errors
        started = time.perf_counter()
        try:
            with self._timed():
                blocks = lent.enter_context(tier.borrow(keys))
        except Exception as error:  # any failure is a miss here
            tier.stats.errors += 1
            tier.last_error = f"{type(error).__name__}: {error}"
            blocks = [None] * len(keys)
        fitting = []
        for key, block in zip(keys, blocks):
            if block is not None and not self._fits(block):
                tier.stats.corrupt += 1
                with self._timed():
                    tier.delete(key)
                block = None
            fitting.append(block)
        hits = sum(block is not None for block in fitting)
        if hits:
            self.restore_seconds[tier.name] += time.perf_counter() - started
            self.restored_blocks[tier.name] += hits
        self.stats.recomputed_blocks += (tier.stats.corrupt - corrupt_before) + (tier.stats.errors - errors_before)
        return fitting

    def _room_for(self, count: int) -> int:
        """Device blocks, up to `count`, that can be had from free blocks and unlocked cached prefixes."""
        if not self.pool.can_allocate(count):
            self.tree.evict(count - self.pool.num_free)
        return min(count, self.pool.num_free)

    def prefetch(self, tokens: Sequence[int], namespace: Namespace) -> Future:
        """Start pulling the blocks of `tokens`' cached prefix that sit in slow tiers (disk, Redis) up
        into the first tier (host RAM), in a background thread, so a later `extend` finds them
        there. Returns a Future of the number of blocks moved."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvwise-prefetch")
        return self._prefetcher.submit(self._prefetch_blocks, list(tokens), namespace)

    def _prefetch_blocks(self, tokens: list[int], namespace: Namespace) -> int:
        if len(self.tiers) < 2:
            return 0
        usable_blocks = (len(tokens) - 1) // self.block_size
        keys = chain_keys(tokens[: usable_blocks * self.block_size], self.block_size, namespace)
        near, moved = self.tiers[0], 0
        for key in keys:
            if near.exists(key):
                continue
            found = next((block for block in (tier.get(key) for tier in self.tiers[1:]) if block is not None), None)
            if found is None or not near.put(key, found):
                break  # a prefix ends at its first missing block
            moved += 1
        return moved

    def fetch(self, key: bytes) -> tuple[str, torch.Tensor] | None:
        """(tier name, block) from the first tier that has `key`, or None."""
        for tier in self.tiers:
            corrupt_before, errors_before = tier.stats.corrupt, tier.stats.errors
            started = time.perf_counter()
            data = self._get(tier, key)
            if data is not None and self._fits(data):
                self.restore_seconds[tier.name] += time.perf_counter() - started
                self.restored_blocks[tier.name] += 1
                return tier.name, data
            if data is not None:  # another geometry under this key (a checkpoint swapped in place)
                tier.stats.corrupt += 1
                with self._timed():
                    tier.delete(key)
            if tier.stats.corrupt > corrupt_before or tier.stats.errors > errors_before:
                self.stats.recomputed_blocks += 1
        return None

    def restore_seconds_per_block(self) -> dict[str, float]:
        """Measured seconds to fetch one block, per tier that has returned any."""
        return {name: self.restore_seconds[name] / count for name, count in list(self.restored_blocks.items()) if count}

    def store_blob(self, key: bytes, blob: torch.Tensor) -> bool:
        """Write an entry that is not one block (a compressed document) to every tier; True when
        one accepted it."""
        return any([self._put(tier, key, blob) for tier in self.tiers])

    def fetch_blob(self, key: bytes) -> torch.Tensor | None:
        """The first tier's entry under `key` that is not one block (checked by its reader), or None."""
        for tier in self.tiers:
            data = self._get(tier, key)
            if data is not None and data.dtype == torch.uint8 and data.dim() == 1:
                return data
        return None

    def _fits(self, data: torch.Tensor) -> bool:
        keys = self.storage.keys
        return data.dtype == keys[0].dtype and tuple(data.shape) == (len(keys), 2, *keys[0].shape[1:])

    def _get(self, tier: Tier, key: bytes) -> torch.Tensor | None:
        """A tier that raises (a bug, an error it did not expect) misses instead of failing the
        step of the request that looked the block up."""
        try:
            with self._timed():
                return tier.get(key)
        except Exception as error:  # any failure is a miss here
            tier.stats.errors += 1
            tier.last_error = f"{type(error).__name__}: {error}"
            return None

    def _put(self, tier: Tier, key: bytes, data: torch.Tensor) -> bool:
        """A tier that raises (out of pinned memory, a bug) refuses the block instead of failing
        the engine step that evicted it."""
        try:
            with self._timed():
                return tier.put(key, data)
        except Exception as error:  # any failure is a refused write here
            tier.stats.errors += 1
            tier.stats.refused_puts += 1
            tier.last_error = f"{type(error).__name__}: {error}"
            return False

    @contextmanager
    def _timed(self) -> Iterator[None]:
        """Adds the time inside the block to `stats.seconds_in_tiers`: a tier that is down must
        cost a step at most one socket timeout, and the engine's step log shows what it did cost."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stats.seconds_in_tiers += time.perf_counter() - started

    def block_tensor(self, block: int) -> torch.Tensor:
        """[num_layers, 2, block_size, num_kv_heads, head_dim] copy of a device block."""
        return self.storage.read_entry(block)
