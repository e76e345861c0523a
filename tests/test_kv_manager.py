"""The KV memory owner: typed block tables, whole-block reads and writes, the one rounding rule,
stats that add up, and no step state left behind by a forward."""

from __future__ import annotations

import pytest
import torch

from kvwise.core.block_pool import BlockPool
from kvwise.core.radix import RadixCache
from kvwise.engine.block_table import BlockTable, Place
from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.kv_manager import KVCacheManager
from kvwise.engine.request import Request
from kvwise.engine.runner import STEP_ATTRIBUTE, paged_attention
from kvwise.engine.sampling import SamplingParams
from kvwise.kv.paged import PagedKVStorage
from kvwise.policies.selection import check_max_kv_tokens, check_ratio, kept_per_head
from tests.conftest import random_ids


def test_a_block_table_says_where_each_block_lives():
    table = BlockTable([4, 5, 6])
    table.move(1, Place.QUANTIZED, 0)
    table.append([9])
    assert table.ids(Place.DEVICE) == [4, 6, 9] and table.ids(Place.QUANTIZED) == [0]
    assert table.indices(Place.QUANTIZED) == [1] and not table.all_in(Place.DEVICE)
    tail = table.cut(2)
    assert len(table) == 2 and tail.block_ids == [6, 9] and tail.all_in(Place.DEVICE)


def test_read_blocks_and_write_blocks_move_whole_blocks_of_every_layer():
    storage = PagedKVStorage(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3)
    keys, values = torch.randn(2, 2, 4, 2, 3), torch.randn(2, 2, 4, 2, 3)
    storage.write_blocks([3, 1], keys, values)
    read_keys, read_values = storage.read_blocks([1, 3])
    assert torch.equal(read_keys, keys[:, [1, 0]]) and torch.equal(read_values, values[:, [1, 0]])
    assert storage.keys[0][[0, 2, 4, 5]].abs().sum() == 0  # nothing else written


def test_one_rounding_rule_and_one_validation():
    assert kept_per_head(57, 0.5) == 28 and kept_per_head(59, 0.5) == 30  # ties to even
    assert kept_per_head(60, 0.9) == 6 and kept_per_head(3, 0.95) == 1  # at least one token
    with pytest.raises(ValueError, match=r"kv_ratio must be in \[0, 1\)"):
        check_ratio(1.0, "kv_ratio")
    with pytest.raises(ValueError, match="max_kv_tokens must be a positive integer"):
        check_max_kv_tokens(0)


def test_can_allocate_reclaims_cached_prefixes_but_never_a_running_request():
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool, RadixCache(pool))
    cached = Request(list(range(9)))
    kv.match(cached)
    assert kv.can_allocate(cached, 9)
    kv.allocate(cached, 9)
    kv.cache_prompt(cached, 8)
    kv.free(cached)  # two blocks stay in the tree, unlocked
    running = Request(list(range(100, 108)))
    kv.match(running)
    kv.allocate(running, 8)
    newcomer = Request(list(range(200, 212)))
    assert not kv.can_allocate(newcomer, 12)  # 3 blocks: the running request's 2 are not reclaimable
    assert pool.num_free == 2 and len(kv._tree) == 0  # but the cached prefix was given up on the way
    assert len(running.blocks) == 2 and running.blocks.all_in(Place.DEVICE)


def test_stats_add_up_after_preemptions_by_host_swap(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16, swap_space_bytes=1 << 24))
    for seed, length in enumerate((9, 14, 11, 7)):
        core.add(core.make_request(random_ids(1, length, seed=seed)[0].tolist(), SamplingParams(max_tokens=20)))
    while core.has_work:
        core.step()
    stats = core.kv.stats()
    assert core.scheduler.preemptions > 0 and stats.swapped_out_blocks == stats.swapped_in_blocks > 0
    assert stats.free_blocks + stats.used_blocks == stats.num_blocks == 16
    assert stats.used_blocks == stats.prefix_cached_blocks  # only the prefix cache holds blocks
    assert 0 < stats.peak_used_blocks <= 16 and stats.swap_used_bytes == 0 and stats.spill_ratio > 0
    assert stats.used_bytes == stats.used_blocks * core.kv._storage.nbytes() // 16


def test_a_forward_leaves_no_step_state_behind(llama):
    core = EngineCore(llama, None, CacheConfig(block_size=4, num_blocks=16))
    core.add(core.make_request(random_ids(1, 9)[0].tolist(), SamplingParams(max_tokens=2)))
    while core.has_work:
        core.step()
    assert not any(hasattr(module, STEP_ATTRIBUTE) for module in llama.modules())
    query = torch.zeros(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="only inside ModelRunner.forward"):
        paged_attention(llama.model.layers[0].self_attn, query, query[:, :2], query[:, :2], None)
