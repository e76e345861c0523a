"""The Redis tier's values against a real redis-server: AES-256-GCM encryption bound to the key
name, key lists and rotation at run time, and reads that are a block or a miss whatever bytes or
types Redis holds (fuzzed with hypothesis)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwise.core.hashing import Namespace, chain_keys
from kvwise.tiers.redis_tier import RedisTier

OLD, NEW, OTHER = (bytes([byte]) * 32 for byte in (1, 2, 3))
KINDS = {"hmac": "hmac_key", "aes-gcm": "encryption_key"}  # kind of key -> RedisTier's argument


def tier_with(url: str, kind: str, keys, **options) -> RedisTier:
    return RedisTier(url, **{KINDS[kind]: keys}, **options)


def rotate(tier: RedisTier, kind: str, keys) -> None:
    tier.set_keys(**{f"{KINDS[kind]}s": keys})  # hmac_keys= or encryption_keys=


def keys(count: int, tenant: str) -> list[bytes]:
    return chain_keys(list(range(count * 4)), 4, Namespace("m", tenant))


def block(seed: int = 0) -> torch.Tensor:
    """[layers, 2, block_size, kv_heads, head_dim], with data bytes that are easy to search for."""
    return (torch.arange(3 * 2 * 4 * 2 * 8, dtype=torch.float32) + 1000 * seed).reshape(3, 2, 4, 2, 8)


def test_encrypted_values_round_trip_and_hide_the_data(redis_server):
    encrypted = RedisTier(redis_server.url, encryption_key=NEW.hex())  # hex, as KVWISE_REDIS_KEY holds it
    plain = RedisTier(redis_server.url, hmac_key=OLD)
    secret_key, plain_key = keys(2, tenant="round-trip")
    data = block(1).numpy().tobytes()
    assert encrypted.encrypted and not plain.encrypted
    assert encrypted.put(secret_key, block(1)) and plain.put(plain_key, block(1))
    assert torch.equal(encrypted.get(secret_key), block(1)) and torch.equal(plain.get(plain_key), block(1))
    raw = encrypted.client.get(encrypted._name(secret_key))
    assert data[:64] not in raw and b"KVWB" not in raw and b"shape" not in raw  # nothing of the block in clear
    assert data in plain.client.get(plain._name(plain_key))  # the same search finds it in a plain value
    assert encrypted.stats.corrupt == 0 and encrypted.stats.hits == 1


def test_a_wrong_key_or_a_renamed_value_is_a_counted_miss(redis_server):
    writer = RedisTier(redis_server.url, encryption_key=NEW)
    stored, moved = keys(2, tenant="rename")
    assert writer.put(stored, block(2))
    wrong = RedisTier(redis_server.url, encryption_key=OTHER)
    assert wrong.get(stored) is None and wrong.stats.corrupt == 1
    assert not writer.exists(stored)  # a value that fails is deleted

    assert writer.put(stored, block(2))
    writer.client.set(writer._name(moved), writer.client.get(writer._name(stored)))  # copied under another name
    assert writer.get(moved) is None and writer.stats.corrupt == 1
    assert torch.equal(writer.get(stored), block(2))  # the original still opens under its own name
    hmac_only = RedisTier(redis_server.url, hmac_key=NEW)  # the other format: a miss, not a crash
    assert hmac_only.get(stored) is None and hmac_only.stats.corrupt == 1


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_rotation_keeps_old_entries_until_the_old_key_is_dropped(redis_server, kind):
    tier = tier_with(redis_server.url, kind, [OLD])
    before, after = keys(2, tenant=f"rotation-{kind}")
    assert tier.put(before, block(3))
    rotate(tier, kind, [NEW, OLD])
    assert torch.equal(tier.get(before), block(3))  # written under the old key, still verifies
    assert tier.put(after, block(4))  # the new key signs
    assert tier_with(redis_server.url, kind, [OLD]).get(after) is None
    assert tier.put(after, block(4))  # (the old-key-only reader deleted it)
    rotate(tier, kind, [NEW])
    assert torch.equal(tier.get(after), block(4))
    assert tier.get(before) is None and tier.stats.corrupt == 1 and not tier.exists(before)


def test_set_keys_checks_before_it_replaces(redis_server, monkeypatch):
    tier = RedisTier(redis_server.url, hmac_key="old")
    for bad, match in (
        ({}, "needs an HMAC key or an encryption key"),
        ({"hmac_keys": ["new", ""]}, "is empty"),
        ({"encryption_keys": "not hex"}, "must be hex"),
        ({"encryption_keys": [NEW, b"short"]}, "32 bytes"),
    ):
        with pytest.raises(ValueError, match=match):
            tier.set_keys(**bad)
        assert tier.hmac_keys == (b"old",) and not tier.encrypted  # the keys in force are kept
    monkeypatch.delenv("KVWISE_REDIS_HMAC_KEY", raising=False)
    monkeypatch.setenv("KVWISE_REDIS_KEY", f"{NEW.hex()},{OLD.hex()}")
    from_environment = RedisTier(redis_server.url)
    assert from_environment.encryption_keys == (NEW, OLD) and not from_environment.hmac_keys
    assert from_environment.encrypted and NEW.hex() not in repr(from_environment._keys)


def test_readers_never_see_half_a_rotation(redis_server):
    """A reader thread while the keys flip between [new, old] and [old, new]: an entry signed
    with old verifies under both, so any miss would be a reader that saw a set half replaced."""
    tier = RedisTier(redis_server.url, hmac_key=[OLD])
    key = keys(1, tenant="concurrent")[0]
    assert tier.put(key, block(5))
    results = []

    def read() -> None:
        results.extend(tier.get(key) is not None for _ in range(300))

    reader = threading.Thread(target=read)
    reader.start()
    while reader.is_alive():
        tier.set_keys([NEW, OLD])
        tier.set_keys([OLD, NEW])
    reader.join()
    assert all(results) and len(results) == 300 and tier.stats.corrupt == 0


# ---- whatever Redis holds, a read is a block or a miss --------------------------------------------
FUZZ_KEY = keys(1, tenant="fuzz")[0]


@pytest.fixture(scope="module")
def fuzz_tiers(redis_server):
    tiers = {kind: tier_with(redis_server.url, kind, NEW, prefix=f"fuzz-{kind}:") for kind in KINDS}
    return {kind: (tier, tier._seal(tier._name(FUZZ_KEY), _payload())) for kind, tier in tiers.items()}


def _payload() -> bytes:
    from kvwise.tiers.payload import encode_block

    return encode_block(FUZZ_KEY, block(6))


def _reads_as_block_or_counted_miss(tier: RedisTier, valid: bytes, value) -> None:
    """`value` under the key's name: get returns the block only for the valid value; anything else
    is a miss, counted corrupt and deleted, and no outage (the fail-fast window stays shut)."""
    name = tier._name(FUZZ_KEY)
    tier.client.delete(name)
    _plant(tier.client, name, value)
    corrupt, errors = tier.stats.corrupt, tier.stats.errors
    found = tier.get(FUZZ_KEY)
    if value == valid:
        assert torch.equal(found, block(6))
        return
    assert found is None and tier.stats.corrupt == corrupt + 1 and tier.stats.errors == errors
    assert not tier.client.exists(name)


def _plant(client, name: bytes, value) -> None:
    """bytes as a string value; (type, members) as a list, set or hash."""
    if isinstance(value, bytes):
        client.set(name, value)
        return
    redis_type, members = value
    if redis_type == "list":
        client.rpush(name, *members)
    elif redis_type == "set":
        client.sadd(name, *members)
    else:
        client.hset(name, mapping=dict.fromkeys(members, b"x"))


FUZZ = settings(max_examples=150, deadline=None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(KINDS))
@FUZZ
@given(st.binary(max_size=600))
def test_random_values_are_misses(fuzz_tiers, kind, value):
    _reads_as_block_or_counted_miss(*fuzz_tiers[kind], value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(KINDS))
@FUZZ
@given(st.data())
def test_damaged_values_are_misses(fuzz_tiers, kind, data):
    tier, valid = fuzz_tiers[kind]
    position = data.draw(st.integers(0, len(valid) - 1))
    flip = data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(valid) - 1))
    extra = data.draw(st.binary(min_size=1, max_size=8))
    flipped = bytearray(valid)
    flipped[position] ^= flip
    for value in (bytes(flipped), valid[:cut], valid + extra, extra + valid, valid):
        _reads_as_block_or_counted_miss(tier, valid, value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=30, deadline=None)
@given(st.sampled_from(["list", "hash", "set"]), st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=4))
def test_values_of_other_types_are_misses(fuzz_tiers, kind, redis_type, members):
    """GET on a list answers WRONGTYPE: bad data under the name, not Redis being down."""
    _reads_as_block_or_counted_miss(*fuzz_tiers[kind], (redis_type, members))
