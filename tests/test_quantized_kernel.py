"""The CPU decode kernel reading quantized blocks where they lie, against dequantize-then-attend."""

from __future__ import annotations

import os

import pytest
import torch

from kvwise.engine.cpu_kernel import quantized_decode_kernel
from kvwise.engine.quantized_kernel import NO_ROLES, kernel_roles
from kvwise.kv.blocks import QuantizedBlocks
from kvwise.kv.quantizer import make_quantizer
from tests.test_cpu_kernel import reference

kernel = quantized_decode_kernel()
pytestmark = [
    pytest.mark.skipif(kernel is None and not os.environ.get("CI"), reason="no C++ compiler: the engine uses SDPA"),
    pytest.mark.timeout(120),
]

# the kernel dequantizes exactly what QuantizedBlocks.read does, in float32 throughout, so the
# only difference left is the order of float32 sums: far below any codec's own error
TOLERANCE = 2e-5


def _attention(query, keys, values, lengths, scale, softcap, window):
    """query [B, H, D]; keys, values [B, L, kv_heads, D] gathered per sequence: test_cpu_kernel's
    reference over a pool that holds each sequence's rows as consecutive blocks."""
    batch = keys.shape[0]
    tables = torch.arange(batch).view(batch, 1)
    return reference(query, keys, values, tables, lengths, scale, softcap, window)


def _mixed_tables(batch: int, blocks_each: int, device_blocks: int, quantized_blocks: int, generator):
    """[B, blocks_each] tables: each entry a pool block (>= 0) or a quantized one (-id - 1), at random."""
    quantized = torch.rand(batch, blocks_each, generator=generator) < 0.6
    pool = torch.randint(0, device_blocks, (batch, blocks_each), generator=generator)
    codes = torch.randint(0, quantized_blocks, (batch, blocks_each), generator=generator)
    return torch.where(quantized, -codes - 1, pool)


def _restored(tables, pool_keys, pool_values, blocks: QuantizedBlocks, count: int):
    """keys, values [B, blocks_each * block_size, kv_heads, D]: every table's blocks, quantized
    ones restored (`count` of them) by QuantizedBlocks.read, the engine's other read path."""
    restored_keys, restored_values = blocks.read(torch.arange(count), torch.float32)
    keys = torch.where(
        (tables < 0)[..., None, None, None], restored_keys[(-tables - 1).clamp_min(0)], pool_keys[tables.clamp_min(0)]
    )
    values = torch.where(
        (tables < 0)[..., None, None, None],
        restored_values[(-tables - 1).clamp_min(0)],
        pool_values[tables.clamp_min(0)],
    )
    return keys.flatten(1, 2), values.flatten(1, 2)


# int8, fp8 and KIVI codes are read in registers where a head is whole 16-byte loads of codes
# (KIVI 4-bit: 32 channels, 2-bit: 64); a channel group of 8, a head of 24 channels, and KIVI
# heads of 48 take the staged path; a KV head shared by five query heads runs as four plus one
@pytest.mark.parametrize(
    "quant", ["int8", "fp8", "kivi4", "kivi2", "kivi4:value_group_size=16", "kivi2:value_group_size=8"]
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "softcap", "window", "threads"),
    [
        (9, 3, 64, 0.0, 0, 1),
        (4, 4, 32, 0.0, 0, 4),
        (8, 2, 64, 50.0, 0, 2),
        (6, 3, 128, 0.0, 11, 1),
        (10, 2, 48, 0.0, 0, 1),
        (4, 2, 24, 0.0, 0, 2),
    ],
)
def test_matches_dequantize_then_attend(quant, heads, kv_heads, dim, softcap, window, threads):
    if quant.endswith("=16") and dim % 16:
        pytest.skip("channel groups of 16 do not divide this head")
    generator = torch.Generator().manual_seed(dim + heads)
    block_size, batch, blocks_each, device_blocks, quantized_blocks = 16, 5, 4, 12, 10
    quantizer = make_quantizer(quant)
    blocks = QuantizedBlocks(quantizer, quantized_blocks, block_size, kv_heads, dim)
    shape = (quantized_blocks, block_size, kv_heads, dim)
    blocks.write(torch.arange(quantized_blocks), torch.randn(shape, generator=generator) + 0.5, torch.randn(shape))
    pool_keys = torch.randn(device_blocks, block_size, kv_heads, dim, generator=generator)
    pool_values = torch.randn(device_blocks, block_size, kv_heads, dim, generator=generator)
    tables = _mixed_tables(batch, blocks_each, device_blocks, quantized_blocks, generator)
    tables[0] = torch.randint(0, device_blocks, (blocks_each,), generator=generator)  # pool blocks only
    tables[1] = -torch.randint(0, quantized_blocks, (blocks_each,), generator=generator) - 1  # quantized only
    lengths = torch.tensor([1, 17, 33, 50, 64])
    query = torch.randn(batch, heads, dim, generator=generator)
    scale = dim**-0.5
    (roles,) = kernel_roles([blocks])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(query, pool_keys, pool_values, tables, lengths, scale, softcap, window, *roles)
    finally:
        torch.set_num_threads(before)
    keys, values = _restored(tables, pool_keys, pool_values, blocks, quantized_blocks)
    expected = _attention(query, keys, values, lengths, scale, softcap, window)
    assert (got - expected).abs().max() < TOLERANCE


@pytest.mark.parametrize("quant", [None, "int8", "kivi4"])
def test_reads_a_bfloat16_pool_as_its_float32_widening(quant):
    """bfloat16 pool blocks widen exactly to float32, so the kernel over the bfloat16 pool gives
    what it gives over that pool in float32, with or without quantized blocks beside them."""
    generator = torch.Generator().manual_seed(7)
    block_size, kv_heads, dim, batch = 16, 3, 64, 4
    pool_keys = torch.randn(8, block_size, kv_heads, dim, generator=generator).bfloat16()
    pool_values = torch.randn(8, block_size, kv_heads, dim, generator=generator).bfloat16()
    tables = torch.randint(0, 8, (batch, 3), generator=generator)
    roles = NO_ROLES
    if quant is not None:
        blocks = QuantizedBlocks(make_quantizer(quant), 4, block_size, kv_heads, dim)
        shape = (4, block_size, kv_heads, dim)
        blocks.write(torch.arange(4), torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        (roles,) = kernel_roles([blocks])
        tables[:, 1] = -torch.randint(0, 4, (batch,), generator=generator) - 1
    lengths, query = torch.tensor([5, 16, 40, 48]), torch.randn(batch, 9, dim, generator=generator)
    got = kernel(query, pool_keys, pool_values, tables, lengths, 0.125, 0.0, 0, *roles)
    wide = kernel(query, pool_keys.float(), pool_values.float(), tables, lengths, 0.125, 0.0, 0, *roles)
    assert (got - wide).abs().max() < TOLERANCE
    if quant is None:
        expected = _attention(
            query,
            pool_keys.float()[tables].flatten(1, 2),
            pool_values.float()[tables].flatten(1, 2),
            lengths,
            0.125,
            0.0,
            0,
        )
        assert (got - expected).abs().max() < TOLERANCE


def test_without_a_quantized_pool_a_quantized_entry_is_refused():
    pool = torch.zeros(2, 16, 1, 32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(torch.randn(1, 2, 32), pool, pool, torch.tensor([[-1]]), torch.tensor([4]), 1.0, 0.0, 0, *NO_ROLES)


def test_a_codec_it_cannot_read_has_no_roles():
    blocks = QuantizedBlocks(make_quantizer("kivi4"), 2, 16, 2, 32)
    assert kernel_roles([blocks]) is not None
    blocks.values.codec = object()  # what a low-rank codec looks like to it: not a codec it knows
    assert kernel_roles([blocks]) is None


def test_out_of_range_quantized_ids_are_refused():
    blocks = QuantizedBlocks(make_quantizer("int8"), 2, 16, 1, 32)
    (roles,) = kernel_roles([blocks])
    pool = torch.zeros(2, 16, 1, 32)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(torch.randn(1, 2, 32), pool, pool, torch.tensor([[-3]]), torch.tensor([4]), 1.0, 0.0, 0, *roles)


@pytest.mark.parametrize("patterns", ["every", "subnormal"])
def test_reads_every_fp8_bit_pattern_as_the_python_decoder_does(patterns):
    """Every float8 e4m3fn pattern (subnormals, the largest normals, both signs, and the NaN
    pattern the codec never writes) is widened in registers to what `QuantizedBlocks.read` gives;
    a cache of subnormals only, so that they are not lost beside the normals."""
    generator = torch.Generator().manual_seed(3)
    block_size, kv_heads, dim, count = 16, 2, 64, 8
    blocks = QuantizedBlocks(make_quantizer("fp8"), count, block_size, kv_heads, dim)
    shape = (count, block_size, kv_heads, dim)
    blocks.write(torch.arange(count), torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    for role in (blocks.keys, blocks.values):
        codes = role.per_token["codes"]
        index = torch.arange(codes.numel())
        token = index // dim  # tokens differ from each other, so scores differ and keys count
        if patterns == "every":
            bits = (index * 7 + token * 13) % 256  # in a scrambled order
        else:
            bits = (index * 3 + token * 5) % 8 + (index // 8 + token) % 2 * 128  # exponent 0, either sign
        codes.copy_(bits.to(torch.uint8).view_as(codes))
    (roles,) = kernel_roles([blocks])
    tables = -torch.arange(count).view(2, 4) - 1
    lengths, query = torch.tensor([64, 57]), torch.randn(2, 4, dim, generator=generator)
    pool = torch.zeros(1, block_size, kv_heads, dim)
    # subnormal keys are about 1e-4 of the largest normals: a larger scale makes their scores count
    scale = 0.02 if patterns == "every" else 2000.0
    got = kernel(query, pool, pool, tables, lengths, scale, 0.0, 0, *roles)
    keys, values = _restored(tables, pool, pool, blocks, count)
    expected = _attention(query, keys, values, lengths, scale, 0.0, 0)
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() < 1e-4 * expected.abs().max()
