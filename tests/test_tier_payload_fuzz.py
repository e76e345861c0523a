"""Every tier's reads are misses, never exceptions, whatever bytes they find: the block format's
decoder fuzzed with hypothesis (random bytes, and valid blocks with bytes flipped, cut or added)."""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwise.tiers.payload import MAGIC, VERSION, CorruptBlock, decode_block, encode_block

KEY = bytes(range(32))
MAC = b"m" * 32
VALID = encode_block(KEY, torch.arange(24, dtype=torch.float32).reshape(2, 3, 4), MAC)


def decodes_or_is_corrupt(payload: bytes, mac_key=MAC) -> None:
    try:
        block = decode_block(KEY, payload, mac_key)
    except CorruptBlock:
        return
    assert payload == VALID and torch.equal(block, torch.arange(24, dtype=torch.float32).reshape(2, 3, 4))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_are_corrupt(payload):
    decodes_or_is_corrupt(payload)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(VALID) - 1), st.integers(1, 255), st.integers(0, len(VALID)), st.binary(max_size=8))
def test_damaged_blocks_are_corrupt(position, flip, cut, extra):
    flipped = bytearray(VALID)
    flipped[position] ^= flip
    for payload in (bytes(flipped), VALID[:cut], VALID + extra if extra else VALID[:-1]):
        decodes_or_is_corrupt(payload)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.text(max_size=12), st.integers(), st.none(), st.lists(st.integers(), max_size=3)),
    st.one_of(st.lists(st.integers(-5, 1 << 40), max_size=10), st.text(max_size=5), st.integers(), st.none()),
)
def test_crafted_headers_are_corrupt(dtype, shape):
    """A forger who writes a header of their own (any dtype name, any shape) still gets a miss."""
    data = b"\x00" * 96
    header = json.dumps({"key": KEY.hex(), "shape": shape, "dtype": dtype, "checksum": "0" * 64}).encode()
    payload = struct.pack("<4sHI", MAGIC, VERSION, len(header)) + header + data
    decodes_or_is_corrupt(payload)


def test_a_block_written_without_the_mac_key_fails():
    forged = encode_block(KEY, torch.ones(2, 3, 4))  # unkeyed checksum
    decodes_or_is_corrupt(forged)
    assert torch.equal(decode_block(KEY, forged), torch.ones(2, 3, 4))  # readable only without a MAC key
