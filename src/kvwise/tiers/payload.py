"""A block's bytes on disk and in Redis: a self-describing header, then the raw tensor data.

    magic "KVWB" | version u16 | header length u32 | header JSON | data

The header holds the block key (hex), shape, dtype and a checksum of the key and data, so a file
that was truncated, bit-flipped or written for another key is detected on read. With a MAC key the
checksum is keyed BLAKE3, a MAC, so a forged entry is detected too; without one it is XXH3-128,
which catches damage only and runs at memory speed. Whatever bytes it is given, `decode_block` returns a block or raises
CorruptBlock, nothing else.
"""

from __future__ import annotations

import hmac
import json
import struct
from collections.abc import Sequence
from functools import lru_cache

import blake3
import torch
import xxhash

MAGIC = b"KVWB"
# 2: compressed documents (head regions) travel in the same payload; 3: BLAKE3 checksums (MACs at
# memory speed); 4: XXH3-128 checksums without a MAC key (BLAKE3 ran at a fifth of a file read).
# An entry of an older version is a miss, read again from the model
VERSION = 4
_PREFIX = struct.Struct("<4sHI")


class CorruptBlock(ValueError):
    """The bytes are not a valid block for this key."""


def _checksum(key: bytes, data: bytes | memoryview, mac_key: bytes | None) -> str:
    """Over the block key and data. With a MAC key, keyed BLAKE3 (a MAC: nobody without the key can
    write an entry that verifies; about 5 GB/s on one core). Without one, XXH3-128: it catches
    damage only, and does so at about 25 GB/s, so checking a restored block costs less than
    reading it from the page cache."""
    digest = blake3.blake3(key=_mac_key32(mac_key)) if mac_key else xxhash.xxh3_128()
    digest.update(key)
    digest.update(data)  # not copied onto the key first
    return digest.hexdigest()


@lru_cache(maxsize=16)
def _mac_key32(mac_key: bytes) -> bytes:
    """BLAKE3's keyed mode takes 32 bytes: derived from a MAC key of any length."""
    return blake3.blake3(mac_key, derive_key_context="kvwise tier entry MAC 2026-12").digest()


def _signing_key(mac_keys: bytes | Sequence[bytes] | None) -> bytes | None:
    if isinstance(mac_keys, bytes | bytearray) or mac_keys is None:
        return mac_keys
    return mac_keys[0] if mac_keys else None


def _verifying_keys(mac_keys: bytes | Sequence[bytes] | None) -> Sequence[bytes | None]:
    if isinstance(mac_keys, bytes | bytearray) or mac_keys is None:
        return [mac_keys]
    return list(mac_keys) or [None]


def encode_block(key: bytes, block: torch.Tensor, mac_key: bytes | Sequence[bytes] | None = None) -> bytes:
    """mac_key: one key, or a list during a rotation: the first signs."""
    mac_key = _signing_key(mac_key)
    data = block.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    header = {
        "key": key.hex(),
        "shape": list(block.shape),
        "dtype": str(block.dtype).removeprefix("torch."),
        "checksum": _checksum(key, data, mac_key),
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes + data


def decode_block(
    key: bytes,
    payload: bytes | bytearray | memoryview,
    mac_key: bytes | Sequence[bytes] | None = None,
    authenticated: bool = False,
) -> torch.Tensor:
    """The tensor in `payload`; raises CorruptBlock if anything does not add up. mac_key: one key,
    or a list during a rotation: an entry signed with any of them verifies. A writable payload (a
    file read into a buffer) becomes the tensor's memory, without a copy; bytes are copied.
    authenticated: the caller verified a MAC over the whole payload (Redis's tag, AES-GCM), so the
    checksum is not computed again."""
    if len(payload) < _PREFIX.size:
        raise CorruptBlock("too short for a block header")
    magic, version, header_length = _PREFIX.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a kvwise block (magic {magic!r}, version {version})")
    try:
        header = json.loads(bytes(payload[_PREFIX.size : _PREFIX.size + header_length]))
        dtype = getattr(torch, str(header["dtype"]), None)
        shape = tuple(header["shape"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise CorruptBlock(f"unreadable header: {error}") from None
    if not isinstance(dtype, torch.dtype):
        raise CorruptBlock(f"unknown dtype {header.get('dtype')!r}")
    if len(shape) > 8 or not all(isinstance(size, int) and 0 <= size < 1 << 31 for size in shape):
        raise CorruptBlock(f"bad shape {shape!r}")
    if header.get("key") != key.hex():
        raise CorruptBlock("the block was written for another key")
    start = _PREFIX.size + header_length
    data = memoryview(payload)[start:]
    checksum = str(header.get("checksum"))
    if not authenticated and not any(
        hmac.compare_digest(_checksum(key, data, one), checksum) for one in _verifying_keys(mac_key)
    ):
        raise CorruptBlock("checksum mismatch")
    expected = torch.Size(shape).numel() * dtype.itemsize
    if len(data) != expected or dtype.is_complex or dtype in (torch.bool,) or not data:
        raise CorruptBlock(f"{len(data)} data bytes for shape {shape} of {dtype}")
    in_place = not memoryview(payload).readonly
    writable, offset = (payload, start) if in_place else (bytearray(data), 0)
    try:
        raw = torch.frombuffer(writable, dtype=torch.uint8, offset=offset, count=len(data))
        return raw.view(dtype).reshape(shape)
    except (RuntimeError, ValueError) as error:  # whatever bytes a forger wrote: a miss, never a crash
        raise CorruptBlock(f"cannot read the data as {dtype}{list(shape)}: {error}") from None
