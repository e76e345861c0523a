"""The block pool and the radix prefix cache: properties over random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvwise.core.block_pool import BlockPool
from kvwise.core.hashing import Namespace, chain_keys
from kvwise.core.radix import PINNED, RadixCache

BLOCK = 4
TENANTS = ("alice", "bob", "carol")


def namespace(tenant: str) -> Namespace:
    return Namespace("smollm2", tenant, "bfloat16")


class PrefixCacheMachine(RuleBasedStateMachine):
    """Requests come and go: match, allocate the rest, insert, lock while running, release."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(num_blocks=24, block_size=BLOCK)
        self.quota = 6
        self.tree = RadixCache(self.pool, eviction="lru", default_quota=self.quota)
        self.running: list[tuple] = []  # (request blocks, locked nodes)

    @rule(
        tenant=st.sampled_from(TENANTS),
        tokens=st.lists(st.integers(0, 3), min_size=0, max_size=5 * BLOCK),
        shared=st.booleans(),
    )
    def start_request(self, tenant, tokens, shared):
        space = namespace(tenant).shared() if shared else namespace(tenant)
        match = self.tree.match_prefix(tokens, space)
        assert match.length % BLOCK == 0 and match.length <= len(tokens)
        for node, start in zip(match.nodes, range(0, match.length, BLOCK)):
            assert node.tokens == tuple(tokens[start : start + BLOCK])  # hits are confirmed by tokens
        needed = -(-(len(tokens) - match.length) // BLOCK)
        if not self.pool.can_allocate(needed):
            self.tree.evict(needed - self.pool.num_free)
        if not self.pool.can_allocate(needed):
            return  # refused before anything changed: check, then act
        self.tree.lock(match.nodes)
        self.pool.incref(match.blocks)
        own = self.pool.allocate(needed)
        blocks = match.blocks + own
        path = self.tree.insert(tokens, blocks, space)
        assert [node.block for node in path] == blocks[: len(path)]
        self.running.append((blocks, match.nodes))

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish_request(self, index):
        blocks, locked = self.running.pop(index % len(self.running))
        self.tree.unlock(locked)
        self.pool.release(blocks)

    @rule(count=st.integers(0, 8))
    def evict(self, count):
        before = len(self.tree)
        evicted = self.tree.evict(count)
        assert evicted <= count and len(self.tree) == before - evicted

    @invariant()
    def free_plus_used_is_total(self):
        stats = self.pool.stats()
        assert stats.free + stats.used == stats.total

    @invariant()
    def no_block_is_both_free_and_referenced(self):
        for block, refs in enumerate(self.pool.ref_counts):
            assert (refs == 0) == self.pool.is_free(block)

    @invariant()
    def tree_and_pool_agree(self):
        expected = [0] * self.pool.num_blocks
        for node in self.tree.nodes():
            expected[node.block] += 1
            assert node.locks >= 0
            assert node.parent.children[node.key] is node
        for blocks, _ in self.running:
            for block in blocks:
                expected[block] += 1
        assert expected == self.pool.ref_counts

    @invariant()
    def quotas_hold(self):
        for tenant in TENANTS:
            assert self.tree.usage[tenant] <= self.quota

    def teardown(self):
        for blocks, locked in self.running:
            self.tree.unlock(locked)
            self.pool.release(blocks)
        self.tree.clear()
        assert len(self.tree) == 0
        assert all(refs == 0 for refs in self.pool.ref_counts)  # reference counts return to zero
        assert self.pool.num_free == self.pool.num_blocks


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_identical_prompts_under_two_tenants_never_share():
    pool = BlockPool(16, BLOCK)
    tree = RadixCache(pool)
    prompt = list(range(12))
    alice_blocks = pool.allocate(3)
    tree.insert(prompt, alice_blocks, namespace("alice"))
    assert tree.match_prefix(prompt, namespace("bob")).length == 0
    assert tree.match_prefix(prompt, namespace("alice")).blocks == alice_blocks
    assert set(chain_keys(prompt, BLOCK, namespace("alice"))).isdisjoint(chain_keys(prompt, BLOCK, namespace("bob")))


def test_the_shared_namespace_is_shared_when_opted_into():
    pool = BlockPool(16, BLOCK)
    tree = RadixCache(pool)
    system_prompt = list(range(8))
    blocks = pool.allocate(2)
    tree.insert(system_prompt, blocks, namespace("alice").shared())
    assert tree.match_prefix(system_prompt, namespace("bob").shared()).blocks == blocks
    assert tree.match_prefix(system_prompt, namespace("bob")).length == 0


def test_keys_change_with_model_and_kv_format():
    tokens = list(range(8))
    base = chain_keys(tokens, BLOCK, Namespace("m", "t", "bfloat16"))
    assert base != chain_keys(tokens, BLOCK, Namespace("m2", "t", "bfloat16"))
    assert base != chain_keys(tokens, BLOCK, Namespace("m", "t", "bfloat16/kivi4"))
    assert base == chain_keys(tokens, BLOCK, Namespace("m", "t", "bfloat16"))


def test_match_stops_at_a_token_mismatch_and_counts_whole_blocks():
    pool = BlockPool(16, BLOCK)
    tree = RadixCache(pool)
    tree.insert(list(range(12)), pool.allocate(3), namespace("a"))
    assert tree.match_prefix(list(range(8)) + [99, 9, 10, 11], namespace("a")).length == 8
    assert tree.match_prefix(list(range(10)), namespace("a")).length == 8  # the partial block is not matched


@pytest.mark.parametrize("eviction, survivor", [("lru", "recent"), ("lfu", "popular")])
def test_eviction_order(eviction, survivor):
    pool = BlockPool(16, BLOCK)
    tree = RadixCache(pool, eviction=eviction)
    popular, recent = [1] * BLOCK, [2] * BLOCK
    for tokens in (popular, recent):
        blocks = pool.allocate(1)
        tree.insert(tokens, blocks, namespace("a"))
        pool.release(blocks)
    for _ in range(3):
        tree.match_prefix(popular, namespace("a"))
    tree.match_prefix(recent, namespace("a"))  # the most recent use
    assert tree.evict(1) == 1
    kept = popular if survivor == "popular" else recent
    assert tree.match_prefix(kept, namespace("a")).length == BLOCK


def test_locked_and_pinned_blocks_are_not_evicted():
    pool = BlockPool(16, BLOCK)
    tree = RadixCache(pool)
    pinned = tree.insert([7] * BLOCK, pool.allocate(1), namespace("a"), priority=PINNED)
    locked = tree.insert([8] * BLOCK, pool.allocate(1), namespace("a"))
    tree.lock(locked)
    assert tree.evict(5) == 0
    tree.unlock(locked)
    assert tree.evict(5) == 1 and len(tree) == 1 and tree.nodes() == pinned


def test_a_tenant_over_quota_evicts_itself_first():
    pool = BlockPool(32, BLOCK)
    tree = RadixCache(pool, quotas={"greedy": 2})
    tree.insert([5] * BLOCK, pool.allocate(1), namespace("quiet"))
    for value in range(4):
        tree.insert([value] * BLOCK, pool.allocate(1), namespace("greedy"))
    assert tree.usage["greedy"] == 2 and tree.usage["quiet"] == 1
    assert tree.match_prefix([5] * BLOCK, namespace("quiet")).length == BLOCK


def test_pool_check_then_act():
    pool = BlockPool(4, BLOCK)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    with pytest.raises(ValueError, match="cannot allocate 5 blocks: 4 of 4 are free"):
        pool.allocate(5)
    assert pool.num_free == 4  # nothing changed
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="already free"):
        pool.release([blocks[0], blocks[0]])
    assert pool.ref_counts[blocks[0]] == 1  # a failed release changes nothing
    released = []
    pool.on_release(released.extend)
    pool.release(blocks)
    assert released == blocks and pool.stats().usage == 0.0


def test_freed_blocks_are_zeroed_before_reuse():
    import torch

    from kvwise.kv.paged import PagedKVStorage

    pool = BlockPool(4, BLOCK)
    storage = PagedKVStorage(num_layers=2, num_blocks=4, block_size=BLOCK, num_kv_heads=2, head_dim=8)
    storage.attach(pool)
    blocks = pool.allocate(2)
    slots = torch.tensor([blocks[0] * BLOCK + offset for offset in range(BLOCK)] + [blocks[1] * BLOCK])
    secret = torch.randn(len(slots), 2, 8)
    for layer in range(2):
        storage.write(layer, slots, secret, secret * 2)
    keys, _ = storage.gather(0, torch.tensor(blocks))
    assert torch.equal(keys[: BLOCK + 1], secret)
    pool.release([blocks[0]])
    # read the freed block's memory directly: nothing of the previous owner is left
    for layer in range(2):
        assert not storage.keys[layer][blocks[0]].any() and not storage.values[layer][blocks[0]].any()
    assert storage.keys[0][blocks[1]].any()  # the block still held is untouched


def test_fair_shares_keep_a_flooding_tenant_from_flushing_another():
    """Without explicit quotas, each tenant holding blocks may hold an equal share of the pool:
    a tenant inserting unique prefixes evicts its own, and another's stay cached."""

    def cached_blocks(fair: bool) -> int:
        pool = BlockPool(num_blocks=32, block_size=BLOCK)
        tree = RadixCache(pool, fair_share=fair)
        kept = list(range(100, 100 + 8 * BLOCK))  # bob: 8 blocks he reuses

        def insert(tokens, tenant):
            blocks = pool.allocate(len(tokens) // BLOCK)
            tree.insert(tokens, blocks, namespace(tenant))
            pool.release(blocks)  # the tree holds what it kept

        insert(kept, "bob")
        for flood in range(40):  # alice: 40 blocks of unique prompts, more than the pool
            tokens = [1000 + flood * BLOCK + i for i in range(BLOCK)]
            if not pool.can_allocate(1):
                tree.evict(1)
            insert(tokens, "alice")
        return tree.match_prefix(kept, namespace("bob"), touch=False).length // BLOCK

    assert cached_blocks(fair=True) == 8
    assert cached_blocks(fair=False) < 8  # the drop fair shares prevent
