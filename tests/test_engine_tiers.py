"""The engine's prefix cache over lower tiers: evicted blocks spill, come back, stay isolated."""

from __future__ import annotations

import random

import pytest
import torch

from kvwise.engine.config import CacheConfig
from kvwise.engine.core import EngineCore
from kvwise.engine.sampling import SamplingParams
from kvwise.tiers.disk import DiskTier
from kvwise.tiers.host import HostTier
from kvwise.util.fingerprint import forget_weights_fingerprint

CONFIG = CacheConfig(block_size=4, num_blocks=40, token_budget=64, max_running=4)


def run(core: EngineCore, prompt: list[int], tenant: str = "default"):
    request = core.make_request(prompt, SamplingParams(max_tokens=4, temperature=0), tenant=tenant)
    core.add(request)
    while core.has_work:
        core.step()
    return request


def flush_device(core: EngineCore, seed: int) -> None:
    """Unrelated prompts until every earlier prefix block is evicted from the device pool."""
    rng = random.Random(seed)
    for _ in range(4):
        run(core, [rng.randrange(3, 128) for _ in range(100)])


def prompt(seed: int, length: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(length)]


def test_evicted_prefix_blocks_come_back_from_the_host_tier(llama):
    with_tier = EngineCore(llama, None, CONFIG, tiers=[HostTier(64 << 20)])
    without = EngineCore(llama, None, CONFIG)
    outputs = {}
    for name, core in (("tier", with_tier), ("none", without)):
        first = run(core, prompt(1))
        flush_device(core, seed=2)
        again = run(core, prompt(1))
        outputs[name] = (first, again)
    first, again = outputs["tier"]
    assert again.output == first.output  # greedy: the restored KV is the KV
    assert again.reused == 40  # all 10 full blocks (the last prompt token is always computed)
    assert with_tier.kv.prefix_stats.hits_tokens["host"] == 40
    assert with_tier.kv.prefix_stats.spilled_blocks >= 10
    assert outputs["none"][1].reused == 0  # the same traffic without a tier loses the prefix


def test_a_corrupt_disk_block_is_recomputed_with_the_same_output(llama, tmp_path):
    core = EngineCore(llama, None, CONFIG, tiers=[DiskTier(tmp_path)])
    first = run(core, prompt(4))
    flush_device(core, seed=5)
    files = sorted(tmp_path.glob("*/*.kvb"))
    assert files, "evicted blocks were not written to disk"
    for path in files:  # flip a byte in every block's data: each one fails its checksum
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    again = run(core, prompt(4))
    assert again.output == first.output
    assert again.reused == 0 and core.kv.prefix_stats.recomputed_blocks >= 1
    assert core.kv.prefix_tiers()[0].stats.corrupt >= 1


def test_a_tier_block_of_another_geometry_is_a_miss_and_leaks_nothing(llama):
    """A key can outlive its model (a checkpoint replaced at the same path, a shared Redis):
    a block of the wrong shape is dropped and recomputed, and every block goes back."""
    host = HostTier(64 << 20)
    core = EngineCore(llama, None, CONFIG, tiers=[host])
    first = run(core, prompt(6))
    flush_device(core, seed=7)
    for key in list(host._blocks):
        host._blocks[key] = torch.zeros(2, 2, 4, 1, 8)
    again = run(core, prompt(6))
    assert again.output == first.output and again.reused == 0 and host.stats.corrupt >= 1
    held = {node.block for node in core.kv._tree.nodes()}
    assert all(count == (block in held) for block, count in enumerate(core.kv._pool.ref_counts))


def test_tenants_do_not_get_each_others_spilled_blocks(llama):
    core = EngineCore(llama, None, CONFIG, tiers=[HostTier(64 << 20)])
    run(core, prompt(7), tenant="alice")
    flush_device(core, seed=8)
    bob = run(core, prompt(7), tenant="bob")
    assert bob.reused == 0 and core.kv.prefix_stats.hits_tokens["host"] == 0
    alice = run(core, prompt(7), tenant="alice")
    assert alice.reused == 40


def test_a_tenant_at_its_quota_cannot_flush_another(llama):
    """A 40-block pool: bob's four prompts would fill it and push alice's prefix out; with a
    quota of 12 blocks, or the default fair shares (20 each), he evicts his own prefixes instead."""
    outcomes = {}
    for name, quota, fair in (("none", None, False), ("quota", 12, False), ("fair", None, True)):
        config = CacheConfig(
            block_size=4,
            num_blocks=40,
            token_budget=64,
            max_running=4,
            prefix_quota_blocks=quota,
            fair_prefix_shares=fair,
        )
        core = EngineCore(llama, None, config)
        run(core, prompt(10), tenant="alice")
        for seed in range(11, 15):
            run(core, prompt(seed), tenant="bob")
        outcomes[name] = (core.kv._tree.usage["bob"], run(core, prompt(10), tenant="alice").reused)
    assert outcomes["none"][1] == 0  # no quota at all: alice's prefix was flushed
    assert outcomes["quota"][0] <= 12 and outcomes["quota"][1] == 40
    assert outcomes["fair"][0] <= 20 and outcomes["fair"][1] == 40


def test_tiers_need_prefix_caching(llama):
    with pytest.raises(ValueError, match="prefix_caching"):
        EngineCore(llama, None, CacheConfig(prefix_caching=False), tiers=[HostTier(1 << 20)])
    with pytest.raises(ValueError, match="prefix_quota_blocks"):
        CacheConfig(prefix_quota_blocks=0)


def test_serve_flags_build_the_tiers_in_order(tmp_path, monkeypatch):
    import argparse

    from kvwise.server.serve import add_serve_arguments, prefix_tiers

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--host-cache-gb", "0.5", "--disk-cache", str(tmp_path), "--disk-cache-gb", "1"])
    host, disk = prefix_tiers(args)
    assert (host.name, host.capacity_bytes) == ("host", 1 << 29)
    assert (disk.name, disk.capacity_bytes, disk.directory) == ("disk", 1 << 30, tmp_path)
    assert prefix_tiers(parser.parse_args([])) == []
    with pytest.raises(ValueError, match="give the directory"):
        prefix_tiers(parser.parse_args(["--disk-cache-gb", "1"]))
    with pytest.raises(ValueError, match="must be >= 0"):
        prefix_tiers(parser.parse_args(["--host-cache-gb", "nan"]))
    with pytest.raises(ValueError, match="no-prefix-caching"):
        prefix_tiers(parser.parse_args(["--host-cache-gb", "1", "--no-prefix-caching"]))
    monkeypatch.delenv("KVWISE_REDIS_HMAC_KEY", raising=False)
    with pytest.raises(ValueError, match="HMAC key"):
        prefix_tiers(parser.parse_args(["--redis-url", "redis://127.0.0.1:1/0"]))


def _damage(kind: str, files: list, directory) -> None:
    """What an attacker with write access to the disk tier, but no key, can do to its files."""
    import shutil

    from kvwise.tiers.payload import encode_block

    for index, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if kind == "corrupted":
            data[len(data) // 2] ^= 0x5A
            path.write_bytes(bytes(data))
        elif kind == "truncated":
            path.write_bytes(bytes(data[: len(data) // 3]))
        elif kind == "renamed":  # every file swapped with the next one's content
            shutil.copyfile(files[(index + 1) % len(files)], path.with_suffix(".swap"))
        elif kind == "forged":  # a well-formed block of zeros, with the unkeyed checksum
            key = bytes.fromhex(path.stem)
            path.write_bytes(encode_block(key, torch.zeros(3, 2, 4, 2, 16)))  # the right shape, no MAC key
    if kind == "renamed":
        for path in files:
            path.with_suffix(".swap").replace(path)


@pytest.mark.parametrize("kind", ["corrupted", "truncated", "renamed", "forged"])
def test_every_tampered_disk_entry_is_detected_counted_and_recomputed(llama, tmp_path, kind):
    mac = b"k" * 32
    core = EngineCore(llama, None, CONFIG, tiers=[DiskTier(tmp_path, mac_key=mac)], namespace_key=b"n" * 32)
    first = run(core, prompt(4))
    flush_device(core, seed=5)
    files = sorted(tmp_path.glob("*/*.kvb"))
    assert len(files) >= 10
    _damage(kind, files, tmp_path)
    disk = core.kv.prefix_tiers()[0]
    again = run(core, prompt(4))
    assert again.output == first.output and again.reused == 0  # nothing tampered is served
    assert disk.stats.corrupt >= 1 and disk.stats.hits == 0


def test_entries_of_other_weights_are_misses(llama, tmp_path):
    """The namespace holds a fingerprint of the weights, not a path: a checkpoint changed in place
    finds nothing of the old one's on a shared disk tier."""
    tier = DiskTier(tmp_path, mac_key=b"k" * 32)
    core = EngineCore(llama, None, CONFIG, tiers=[tier], namespace_key=b"n" * 32)
    run(core, prompt(4))
    flush_device(core, seed=5)
    with torch.no_grad():
        llama.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # new weights, same object and path
    forget_weights_fingerprint(llama)
    retrained = EngineCore(llama, None, CONFIG, tiers=[DiskTier(tmp_path, mac_key=b"k" * 32)], namespace_key=b"n" * 32)
    again = run(retrained, prompt(4))
    assert again.reused == 0 and retrained.kv.prefix_stats.hits_tokens.get("disk", 0) == 0


def test_a_tier_that_raises_on_read_is_a_miss_not_a_failed_step(llama):
    class Broken(HostTier):
        def get(self, key):
            raise RuntimeError("a bug in a tier")

        def borrow(self, keys):  # a restore reads through borrow
            raise RuntimeError("a bug in a tier")

    core = EngineCore(llama, None, CONFIG, tiers=[Broken(64 << 20)])
    first = run(core, prompt(4))
    flush_device(core, seed=5)
    again = run(core, prompt(4))
    assert again.output == first.output and again.reused == 0 and again.error is None
    assert core.kv.prefix_tiers()[0].stats.errors >= 1 and "a bug in a tier" in core.kv.prefix_tiers()[0].last_error
