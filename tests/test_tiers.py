"""Host, disk and Redis tiers: round trips, corruption, tampering, outages, a full disk."""

from __future__ import annotations

import errno

import pytest
import torch

from kvwise.core.hashing import Namespace, chain_keys
from kvwise.tiers.disk import DiskTier
from kvwise.tiers.host import HostTier
from kvwise.tiers.payload import encode_block
from kvwise.tiers.redis_tier import RedisTier
from tests.redis_servers import start_cluster, start_redis

HMAC_KEY = "test-hmac-key"


def keys(count: int, tenant: str = "t") -> list[bytes]:
    return chain_keys(list(range(count * 4)), 4, Namespace("m", tenant))


def block(seed: int = 0) -> torch.Tensor:
    """A block as the engine spills it: [layers, 2 (keys, values), block_size, kv_heads, head_dim]."""
    return torch.randn(3, 2, 4, 2, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_host_tier_is_a_byte_bounded_lru():
    one = block().nbytes
    tier = HostTier(capacity_bytes=2 * one)
    first, second, third = keys(3)
    assert tier.put(first, block(1)) and tier.put(second, block(2))
    assert torch.equal(tier.get(first), block(1))  # first is now the most recent
    assert tier.put(third, block(3))
    assert tier.exists(first) and not tier.exists(second) and tier.exists(third)
    assert tier.stats.bytes_held == 2 * one
    assert not HostTier(capacity_bytes=one - 1).put(first, block())  # larger than the tier: refused


def test_a_lent_host_entry_is_neither_evicted_nor_zeroed_until_it_comes_back():
    one = block().nbytes
    tier = HostTier(capacity_bytes=2 * one)
    first, second, third = keys(3)
    tier.put(first, block(1))
    tier.put(second, block(2))
    with tier.borrow([first, third]) as lent:
        assert lent[1] is None and torch.equal(lent[0], block(1))
        assert lent[0].data_ptr() == tier._blocks[first].data_ptr()  # the entry itself: no copy
        assert tier.put(third, block(3))  # room comes from `second`, not the lent `first`
        assert tier.exists(first) and not tier.exists(second)
        assert not tier.put(keys(4)[3], block(4)) or tier.exists(first)  # never by evicting `first`
        tier.delete(first)
        assert torch.equal(lent[0], block(1))  # deleted meanwhile: still readable while lent
    assert not lent[0].any()  # zeroed once it came back
    assert tier.stats.bytes_held <= 2 * one


def test_disk_round_trip_is_atomic(tmp_path):
    tier = DiskTier(tmp_path)
    key = keys(1)[0]
    assert tier.put(key, block(4))
    assert torch.equal(tier.get(key), block(4))
    assert tier.path(key).exists() and not list(tmp_path.rglob("*.tmp"))
    assert tier.path(key).read_bytes()[:4] == b"KVWB"
    assert DiskTier(tmp_path).stats.bytes_held == tier.stats.bytes_held  # a restart finds the files


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_key"])
def test_a_corrupted_disk_file_is_detected_deleted_and_counted(tmp_path, damage):
    tier = DiskTier(tmp_path)
    key, other = keys(2)
    tier.put(key, block(5))
    path = tier.path(key)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(encode_block(other, block(5)))  # a valid block, but for another key
    path.write_bytes(bytes(data))
    assert tier.get(key) is None
    assert tier.stats.corrupt == 1 and not path.exists()


def test_disk_encryption_hides_data_and_rejects_the_wrong_key(tmp_path):
    secret = bytes(range(32))
    tier = DiskTier(tmp_path, encryption_key=secret)
    key = keys(1)[0]
    data = block(6)
    tier.put(key, data)
    raw = tier.path(key).read_bytes()
    assert b"KVWB" not in raw and data.view(torch.uint8).numpy().tobytes()[:32] not in raw
    assert torch.equal(tier.get(key), data)
    intruder = DiskTier(tmp_path, encryption_key=bytes(32))
    assert intruder.get(key) is None and intruder.stats.corrupt == 1
    with pytest.raises(ValueError, match="32 bytes"):
        DiskTier(tmp_path, encryption_key=b"short")


def test_a_full_disk_refuses_writes_and_nothing_else_breaks(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path)
    stored, refused = keys(2)
    assert tier.put(stored, block(7))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("kvwise.tiers.disk.os.replace", disk_full)
    assert tier.put(refused, block(8)) is False
    assert tier.stats.refused_puts == 1 and "No space left" in tier.last_error
    assert not list(tmp_path.rglob("*.tmp"))  # the partial file is gone
    assert torch.equal(tier.get(stored), block(7)) and tier.get(refused) is None
    capped = DiskTier(tmp_path / "capped", capacity_bytes=100)
    assert capped.put(stored, block(7)) is False and capped.last_error == "capacity reached"


def test_redis_round_trip_with_ttl(redis_server):
    tier = RedisTier(redis_server.url, hmac_key=HMAC_KEY, ttl_seconds=60)
    key = keys(1, tenant="round-trip")[0]
    assert tier.put(key, block(9)) and tier.exists(key)
    assert torch.equal(tier.get(key), block(9))
    assert 0 < tier.client.ttl(tier._name(key)) <= 60
    tier.delete(key)
    assert not tier.exists(key) and tier.get(key) is None


def test_redis_reads_many_blocks_in_one_round_trip(redis_server):
    tier = RedisTier(redis_server.url, hmac_key=HMAC_KEY, ttl_seconds=60)
    present, absent, tampered = keys(3, tenant="many")
    tier.put(present, block(5))
    tier.put(tampered, block(6))
    value = bytearray(tier.client.get(tier._name(tampered)))
    value[-1] ^= 0x01
    tier.client.set(tier._name(tampered), bytes(value))
    calls = []
    execute = tier.client.pipeline

    def counting(*args, **kwargs):
        calls.append(1)
        return execute(*args, **kwargs)

    tier.client.pipeline = counting
    got = tier.get_many([present, absent, tampered])
    assert len(calls) == 1 and torch.equal(got[0], block(5)) and got[1] is None and got[2] is None
    assert tier.stats.corrupt == 1 and not tier.exists(tampered)


def test_redis_rejects_tampered_and_unauthenticated_entries(redis_server):
    tier = RedisTier(redis_server.url, hmac_key=HMAC_KEY)
    tampered, forged = keys(2, tenant="tamper")
    tier.put(tampered, block(10))
    value = bytearray(tier.client.get(tier._name(tampered)))
    value[-1] ^= 0x01
    tier.client.set(tier._name(tampered), bytes(value))
    assert tier.get(tampered) is None and not tier.exists(tampered)
    # someone without the key writes a well-formed block
    RedisTier(redis_server.url, hmac_key="not-the-key").put(forged, block(11))
    assert tier.get(forged) is None
    assert tier.stats.corrupt == 2
    with pytest.raises(ValueError, match="needs an HMAC key"):
        RedisTier(redis_server.url, hmac_key="")


def test_redis_down_is_a_miss_not_a_failure(tmp_path):
    server = start_redis(tmp_path / "doomed")
    tier = RedisTier(server.url, hmac_key=HMAC_KEY, timeout_seconds=0.2)
    key, later = keys(2, tenant="outage")
    assert tier.put(key, block(12))
    server.stop()
    assert tier.get(key) is None and tier.put(later, block(13)) is False and tier.exists(key) is False
    assert tier.stats.errors >= 3 and tier.last_error


def test_redis_down_fails_fast_until_retry(tmp_path, monkeypatch):
    """After one failure the tier does not wait out a socket timeout per call (the engine spills
    on its own thread); once retry_seconds pass it tries Redis again."""
    server = start_redis(tmp_path / "flaky")
    tier = RedisTier(server.url, hmac_key=HMAC_KEY, timeout_seconds=0.2, retry_seconds=3600)
    key = keys(1, tenant="flaky")[0]
    server.stop()
    assert tier.put(key, block(14)) is False  # the one call that meets the dead socket

    def untouched(*args, **kwargs):
        raise AssertionError("Redis was called while resting")

    for method in ("get", "set", "exists", "delete"):
        monkeypatch.setattr(tier.client, method, untouched)
    assert tier.get(key) is None and tier.put(key, block(14)) is False and not tier.exists(key)
    tier.delete(key)
    tier._down_until = 0.0  # the retry time has passed
    asked = []
    monkeypatch.setattr(tier.client, "get", lambda name: asked.append(name))
    assert tier.get(key) is None and asked  # Redis asked again (a miss)


def test_redis_cluster_of_three_nodes(tmp_path):
    servers = start_cluster(tmp_path)
    try:
        tier = RedisTier(servers[0].url.removesuffix("/0"), hmac_key=HMAC_KEY, cluster=True)
        entries = keys(24, tenant="cluster")
        for index, key in enumerate(entries):
            assert tier.put(key, block(index))
        for index, key in enumerate(entries):
            assert torch.equal(tier.get(key), block(index))
        holders = {node.port for node in servers if tier.client.get_node_from_key(tier._name(entries[0]))}
        assert holders
        slots = {tier.client.keyslot(tier._name(key)) for key in entries}
        assert len(slots) > 3  # the keys really spread over the cluster's slots
    finally:
        for server in servers:
            server.stop()


def test_a_file_cut_short_behind_the_tier_leaves_no_bytes_counted_once_deleted(tmp_path):
    tier = DiskTier(tmp_path)
    block = torch.ones(2, 4, 8)
    tier.put(b"k" * 32, block)
    path = tier.path(b"k" * 32)
    path.write_bytes(path.read_bytes()[:10])  # truncated by someone else
    assert tier.get(b"k" * 32) is None and tier.stats.corrupt == 1  # detected and deleted
    assert tier.stats.bytes_held == 0 and not path.exists()
