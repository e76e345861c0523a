"""A block's bytes on disk and in Redis: a self-describing header, then the raw tensor data.

    magic "KVWB" | version u16 | header length u32 | header JSON | data

The header holds the block key (hex), shape, dtype and a BLAKE2b checksum of the data, so a
file that was truncated, bit-flipped or written for another key is detected on read.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch

MAGIC = b"KVWB"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")


class CorruptBlock(ValueError):
    """The bytes are not a valid block for this key."""


def encode_block(key: bytes, block: torch.Tensor) -> bytes:
    data = block.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    header = {
        "key": key.hex(),
        "shape": list(block.shape),
        "dtype": str(block.dtype).removeprefix("torch."),
        "checksum": hashlib.blake2b(data, digest_size=16).hexdigest(),
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes + data


def decode_block(key: bytes, payload: bytes) -> torch.Tensor:
    """The tensor in `payload`; raises CorruptBlock if anything does not add up."""
    if len(payload) < _PREFIX.size:
        raise CorruptBlock("too short for a block header")
    magic, version, header_length = _PREFIX.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise CorruptBlock(f"not a kvwise block (magic {magic!r}, version {version})")
    try:
        header = json.loads(payload[_PREFIX.size : _PREFIX.size + header_length])
        dtype = getattr(torch, header["dtype"])
        shape = tuple(header["shape"])
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptBlock(f"unreadable header: {error}") from None
    if header.get("key") != key.hex():
        raise CorruptBlock("the block was written for another key")
    data = payload[_PREFIX.size + header_length :]
    if hashlib.blake2b(data, digest_size=16).hexdigest() != header.get("checksum"):
        raise CorruptBlock("checksum mismatch")
    expected = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if len(data) != expected:
        raise CorruptBlock(f"{len(data)} data bytes for shape {shape} of {dtype}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
