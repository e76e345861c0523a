"""Prefix reuse on the library path: same greedy tokens, hits from every tier, faults recomputed."""

from __future__ import annotations

import torch

from kvwise.hf.prefix_reuse import PrefixReuse
from kvwise.tiers.disk import DiskTier
from kvwise.tiers.host import HostTier
from kvwise.tiers.redis_tier import RedisTier
from tests.conftest import random_ids
from tests.redis_servers import start_redis

GENERATE = {"max_new_tokens": 8, "do_sample": False}


def plain_generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, **GENERATE)


def prompts(shared_length=40, seeds=(11, 12, 13)):
    shared = random_ids(1, shared_length, seed=10)
    return [torch.cat([shared, random_ids(1, 7, seed=seed)], 1) for seed in seeds]


def test_reuse_gives_the_same_greedy_tokens(llama):
    llama.set_attn_implementation("sdpa")
    reuse = PrefixReuse(llama, block_size=8, device_blocks=32)
    for ids in prompts():
        assert torch.equal(reuse.generate(ids, **GENERATE), plain_generate(llama, ids))
    # the 40-token prefix (5 blocks) was computed once and hit twice
    assert reuse.stats.hits_tokens["device"] == 2 * 40
    assert reuse.stats.queries_tokens == 3 * 40
    assert 0.6 < reuse.stats.hit_rate < 0.7


def test_other_tenants_do_not_hit_and_shared_opt_in_does(llama):
    llama.set_attn_implementation("sdpa")
    ids = prompts()[0]
    alice = PrefixReuse(llama, tenant="alice", block_size=8)
    alice.generate(ids, **GENERATE)
    bob_tree_view = PrefixReuse(llama, tenant="bob", block_size=8)
    bob_tree_view.tree, bob_tree_view.pool, bob_tree_view.storage = alice.tree, alice.pool, alice.storage
    bob_tree_view.generate(ids, **GENERATE)
    assert bob_tree_view.stats.hits_tokens["device"] == 0
    public = PrefixReuse(llama, tenant="alice", shared=True, block_size=8)
    public.generate(ids, **GENERATE)
    carol = PrefixReuse(llama, tenant="carol", shared=True, block_size=8)
    carol.tree, carol.pool, carol.storage = public.tree, public.pool, public.storage
    carol.generate(ids, **GENERATE)
    assert carol.stats.hits_tokens["device"] == 40


def test_evicted_blocks_come_back_from_host_and_disk(llama, tmp_path):
    llama.set_attn_implementation("sdpa")
    first, second = prompts(seeds=(21, 22))[0], random_ids(1, 47, seed=99)
    host = HostTier(capacity_bytes=1 << 30)
    reuse = PrefixReuse(llama, block_size=8, device_blocks=6, tiers=[host, DiskTier(tmp_path)])
    reuse.generate(first, **GENERATE)
    reuse.generate(second, **GENERATE)  # needs the whole device pool: the first prompt's blocks spill
    assert reuse.stats.evictions > 0 and reuse.stats.spill_ratio == 1.0
    assert torch.equal(reuse.generate(first, **GENERATE), plain_generate(llama, first))
    assert reuse.stats.hits_tokens["host"] > 0
    reuse.tree.clear()  # every device block spills to host and disk ...
    for key in list(host._blocks):
        host.delete(key)  # ... and the host forgets them: only the disk has the prefix now
    assert torch.equal(reuse.generate(first, **GENERATE), plain_generate(llama, first))
    assert reuse.stats.hits_tokens["disk"] > 0


def test_a_corrupt_disk_block_is_recomputed(llama, tmp_path):
    llama.set_attn_implementation("sdpa")
    ids = prompts()[0]
    disk = DiskTier(tmp_path)
    reuse = PrefixReuse(llama, block_size=8, device_blocks=16, tiers=[disk])
    reuse.generate(ids, **GENERATE)
    reuse.tree.clear()  # everything spills to disk
    files = sorted(tmp_path.rglob("*.kvb"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    assert torch.equal(reuse.generate(ids, **GENERATE), plain_generate(llama, ids))
    assert disk.stats.corrupt >= 1 and reuse.stats.recomputed_blocks >= 1
    report = reuse.report()
    assert report["corrupt"]["disk"] == disk.stats.corrupt and report["bytes_held"]["device"] > 0
    assert set(report) >= {"hits_tokens", "hit_rate", "spill_ratio", "evictions", "errors"}


def test_redis_stopped_mid_run_still_serves_correctly(llama, tmp_path):
    llama.set_attn_implementation("sdpa")
    server = start_redis(tmp_path / "redis")
    try:
        redis_tier = RedisTier(server.url, hmac_key="k", timeout_seconds=0.2)
        reuse = PrefixReuse(llama, block_size=8, device_blocks=16, tiers=[redis_tier])
        ids = prompts()[0]
        reuse.generate(ids, **GENERATE)
        reuse.tree.clear()  # spilled to Redis
        assert torch.equal(reuse.generate(ids, **GENERATE), plain_generate(llama, ids))
        assert reuse.stats.hits_tokens["redis"] == 40
        reuse.tree.clear()
        server.stop()
        assert torch.equal(reuse.generate(ids, **GENERATE), plain_generate(llama, ids))
        assert redis_tier.stats.errors > 0
    finally:
        server.stop()


def test_prefetch_pulls_slow_blocks_into_host_ram(llama, tmp_path):
    llama.set_attn_implementation("sdpa")
    ids = prompts()[0]
    host, disk = HostTier(capacity_bytes=1 << 30), DiskTier(tmp_path)
    reuse = PrefixReuse(llama, block_size=8, device_blocks=16, tiers=[host, disk])
    reuse.generate(ids, **GENERATE)
    reuse.tree.clear()
    for key in list(host._blocks):
        host.delete(key)  # only the disk holds the prefix now
    assert reuse.prefetch(ids).result(timeout=30) == 5
    assert torch.equal(reuse.generate(ids, **GENERATE), plain_generate(llama, ids))
    assert reuse.stats.hits_tokens["host"] == 40 and reuse.stats.hits_tokens["disk"] == 0
