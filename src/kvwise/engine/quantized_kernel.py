"""What the CPU decode kernel needs to read a `QuantPool`'s blocks where they lie
(kernels/quantized_decode.cpp): for each layer, each role's (keys', values') codec kind, code
width and tensors, as `kv/blocks.py` stores them. The same kernel reads a bfloat16 pool, with
`NO_ROLES` when no block is quantized.

Int8 and FP8 (one scale per token) and KIVI's min/max codecs (keys per channel with one group per
block and head, values per token in channel groups) are read in place; a low-rank codec, or any
other, is not (None), and its requests are attended after `QuantPool.read` restores their blocks.
"""

from __future__ import annotations

import torch

from kvwise.kv.blocks import CodecPool, QuantizedBlocks
from kvwise.kv.minmax import ChannelCodec, TokenCodec
from kvwise.kv.scaled import Fp8Codec, Int8Codec

# the kernel's role kinds (quantized_decode.cpp's Kind)
NONE, SCALED_INT8, SCALED_FP8, PER_CHANNEL, PER_TOKEN = -1, 0, 1, 2, 3

_UNUSED_CODES, _UNUSED_SCALES = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.float16)
# both roles when no block of a call is quantized (plain requests over a bfloat16 pool)
NO_ROLES = (NONE, 8, 0, _UNUSED_CODES, _UNUSED_SCALES, _UNUSED_SCALES) * 2


def kernel_roles(layers: list[QuantizedBlocks]) -> list[tuple] | None:
    """Per layer, the kernel's key and value arguments (12 values: kind, bits, channel group,
    codes, scales, minimums for each role); None when a codec is not one the kernel reads."""
    roles = []
    for blocks in layers:
        keys, values = _role(blocks.keys), _role(blocks.values)
        if keys is None or values is None:
            return None
        roles.append((*keys, *values))
    return roles


def _role(pool: CodecPool) -> tuple | None:
    codec = pool.codec
    if type(codec) is Int8Codec or type(codec) is Fp8Codec:
        kind = SCALED_INT8 if type(codec) is Int8Codec else SCALED_FP8
        return kind, 8, 0, pool.per_token["codes"], pool.per_token["scale"], _UNUSED_SCALES
    if type(codec) is ChannelCodec:
        return PER_CHANNEL, codec.bits, 0, pool.per_token["codes"], pool.per_group["scale"], pool.per_group["min"]
    if type(codec) is TokenCodec:
        codes = pool.per_token["codes"]
        head_dim = codes.shape[-1] * 8 // codec.bits
        width = min(codec.channel_group, head_dim)  # as TokenCodec groups a narrow head
        return PER_TOKEN, codec.bits, width, codes, pool.per_token["scale"], pool.per_token["min"]
    return None
