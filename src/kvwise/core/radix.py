"""`RadixCache`: a prefix tree over block-aligned token chunks, with tenants and quotas.

Each node is one full block of `block_size` tokens. Its key chains the parent's key, the tokens
and the namespace (`core.hashing`), so every node is also reachable in O(1) by key, and a lookup
costs one hash per block. A hit is confirmed by comparing the node's tokens.

The tree holds one pool reference per node; requests in flight `lock` the nodes they use, and
only unlocked leaves can be evicted. Eviction order:
  1. leaves of tenants over their quota (so one tenant cannot flush the others);
  2. then by priority (pinned nodes, priority = PINNED, are never evicted);
  3. then least recently used (`lru`) or least frequently used (`lfu`).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import ROOT_KEY, Namespace, SegmentedNamespace, block_key

PINNED = math.inf
EVICTION_POLICIES = ("lru", "lfu")


@dataclass(eq=False)
class Node:
    key: bytes
    tokens: tuple[int, ...]
    block: int
    tenant: str
    parent: Node | None
    children: dict[bytes, Node] = field(default_factory=dict)
    locks: int = 0
    last_access: int = 0
    hits: int = 0
    priority: float = 0.0


@dataclass
class Match:
    """The longest cached prefix: its nodes and blocks, and how many tokens they cover."""

    nodes: list[Node]
    length: int

    @property
    def blocks(self) -> list[int]:
        return [node.block for node in self.nodes]


class RadixCache:
    """Args:
    pool: the block pool whose blocks the tree references.
    eviction: "lru" or "lfu".
    quotas: blocks per tenant; tenants not listed get `default_quota` (None: unlimited, or with
        `fair_share` an equal share of the pool per tenant holding blocks).
    on_evict: called with each evicted node before its block is released (write-back to tiers).
    on_insert: called with each node `insert` adds, when `insert` is asked to announce it
        (publishing newly computed blocks to a shared tier).
    """

    def __init__(
        self,
        pool: BlockPool,
        eviction: str = "lru",
        quotas: dict[str, int] | None = None,
        default_quota: int | None = None,
        on_evict: Callable[[Node], None] | None = None,
        fair_share: bool = False,
    ):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}; choose one of: {', '.join(EVICTION_POLICIES)}")
        self.pool, self.block_size, self.eviction = pool, pool.block_size, eviction
        self.quotas, self.default_quota, self.fair_share = dict(quotas or {}), default_quota, fair_share
        self.on_evict = on_evict
        self.on_insert: Callable[[Node], None] | None = None
        self.root = Node(ROOT_KEY, (), -1, "", None)
        self._by_key: dict[bytes, Node] = {}
        self.usage: Counter[str] = Counter()  # blocks held per tenant
        self._clock = itertools.count(1)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def quota(self, tenant: str) -> float:
        """Blocks `tenant` may hold: its own quota, the default one, or with `fair_share` an equal
        share of the pool among the tenants that hold blocks (so a tenant flooding unique prompts
        evicts its own prefixes, not the others')."""
        quota = self.quotas.get(tenant, self.default_quota)
        if quota is not None:
            return quota
        if not self.fair_share:
            return math.inf
        others = sum(1 for name, held in self.usage.items() if held > 0 and name != tenant)
        if others == 0:
            return math.inf  # alone, a tenant may use the whole pool
        return max(1, self.pool.num_blocks // (others + 1))

    # ---- lookups -----------------------------------------------------------------------------
    def match_prefix(
        self, token_ids: Sequence[int], namespace: Namespace | SegmentedNamespace, touch: bool = True
    ) -> Match:
        """The longest run of cached full blocks at the start of `token_ids`; `touch` counts the
        lookup as a use (LRU/LFU). A scheduler only comparing waiting requests passes False."""
        parent_key, nodes = ROOT_KEY, []
        now = next(self._clock)
        for index, start in enumerate(range(0, len(token_ids) - self.block_size + 1, self.block_size)):
            chunk = tuple(token_ids[start : start + self.block_size])
            key = block_key(parent_key, chunk, namespace.digest_at(index))
            node = self._by_key.get(key)
            if node is None or node.tokens != chunk:  # a hash collision never counts as a hit
                break
            if touch:
                node.last_access, node.hits = now, node.hits + 1
            nodes.append(node)
            parent_key = key
        return Match(nodes, len(nodes) * self.block_size)

    def insert(
        self,
        token_ids: Sequence[int],
        blocks: Sequence[int],
        namespace: Namespace | SegmentedNamespace,
        priority: float = 0.0,
        announce: bool = False,
    ) -> list[Node]:
        """Cache the full blocks of `token_ids`, held in `blocks` (one per full block).

        Blocks already cached are left alone (the caller keeps its own copy); new nodes take a
        pool reference to the caller's block. A tenant at its quota first evicts its own
        unlocked leaves; what still does not fit is not cached. Returns the path's nodes.
        announce: pass each new node to `on_insert` (blocks just computed, not ones brought back).
        """
        full_blocks = len(token_ids) // self.block_size
        if len(blocks) < full_blocks:
            raise ValueError(f"{full_blocks} full blocks of tokens need {full_blocks} block ids, got {len(blocks)}")
        parent, path = self.root, []
        now = next(self._clock)
        for index in range(full_blocks):
            chunk = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
            key = block_key(parent.key, chunk, namespace.digest_at(index))
            node = self._by_key.get(key)
            if node is not None and node.tokens != chunk:
                break  # a collision: never overwrite, never confuse
            if node is None:
                if not self._make_room_for(namespace.tenant, protect=parent):
                    break
                node = Node(key, chunk, blocks[index], namespace.tenant, parent, priority=priority)
                self.pool.incref([node.block])
                parent.children[key] = node
                self._by_key[key] = node
                self.usage[namespace.tenant] += 1
                if announce and self.on_insert is not None:
                    self.on_insert(node)
            node.last_access = now
            node.priority = max(node.priority, priority)
            path.append(node)
            parent = node
        return path

    def _make_room_for(self, tenant: str, protect: Node) -> bool:
        if self.usage[tenant] < self.quota(tenant):
            return True
        return self._evict(1, only_tenant=tenant, protect=protect) == 1

    # ---- in-flight requests ------------------------------------------------------------------
    def lock(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            node.locks += 1

    def unlock(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            if node.locks == 0:
                raise ValueError("unlock without a matching lock")
        for node in nodes:
            node.locks -= 1

    # ---- eviction ----------------------------------------------------------------------------
    def evictable(self, node: Node) -> bool:
        return not node.children and node.locks == 0 and node.priority != PINNED and node is not self.root

    def reclaimable(self) -> int:
        """Blocks evicting could give back to the pool now: unlocked, unpinned nodes whose block
        nobody else holds (a running request's blocks stay however the tree changes)."""
        counts = self.pool.ref_counts
        return sum(
            1
            for node in self._by_key.values()
            if node.locks == 0 and node.priority != PINNED and counts[node.block] == 1
        )

    def evict(self, count: int) -> int:
        """Evict up to `count` unlocked leaves (parents become leaves as it goes); returns how many."""
        return self._evict(count, only_tenant=None, protect=None)

    def _order(self, node: Node) -> tuple:
        # insert() keeps a tenant at or under its quota, so "at" is the state to evict first from
        over_quota = self.usage[node.tenant] >= self.quota(node.tenant)
        use = (node.hits, node.last_access) if self.eviction == "lfu" else (node.last_access, node.hits)
        # a block a running request still holds frees no memory when its node goes: those go last
        in_use = self.pool.ref_counts[node.block] > 1
        return (not over_quota, in_use, node.priority, *use)

    def _evict(self, count: int, only_tenant: str | None, protect: Node | None) -> int:
        candidates = [
            node
            for node in self._by_key.values()
            if self.evictable(node) and node is not protect and (only_tenant is None or node.tenant == only_tenant)
        ]
        tie = itertools.count()
        heap = [(self._order(node), next(tie), node) for node in candidates]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < count:
            _, _, node = heapq.heappop(heap)
            if not self.evictable(node) or node.key not in self._by_key:
                continue
            self._remove(node)
            evicted += 1
            parent = node.parent
            if parent is not protect and self.evictable(parent) and (only_tenant in (None, parent.tenant)):
                heapq.heappush(heap, (self._order(parent), next(tie), parent))
        return evicted

    def _remove(self, node: Node) -> None:
        if self.on_evict is not None:
            self.on_evict(node)
        del node.parent.children[node.key]
        del self._by_key[node.key]
        self.usage[node.tenant] -= 1
        self.evictions += 1
        self.pool.release([node.block])

    def clear(self) -> None:
        """Evict everything that is not locked (pinned nodes included)."""
        for node in list(self._by_key.values()):
            node.priority = min(node.priority, 0.0)
        self.evict(len(self._by_key))

    def nodes(self) -> list[Node]:
        return list(self._by_key.values())

    def keys(self) -> list[bytes]:
        """Every cached block's key (one C-level copy: safe to call while another thread inserts)."""
        return list(self._by_key)
