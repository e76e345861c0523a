"""Packing, codecs and their stated error bounds, on random rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwise import make_quantizer
from kvwise.kv.minmax import ChannelCodec, TokenCodec
from kvwise.kv.packing import pack, unpack
from kvwise.kv.scaled import Fp8Codec, Int8Codec


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 9), width_units=st.integers(1, 12), seed=st.integers(0, 10**6)
)
def test_pack_unpack_is_exact(bits, rows, width_units, seed):
    width = width_units * (8 // bits)
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, width), generator=generator, dtype=torch.int64).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, width * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_packing_really_shrinks_and_orders_low_bits_first():
    codes = torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]
    assert pack(torch.tensor([[5, 9]], dtype=torch.uint8), 4).tolist() == [[5 | 9 << 4]]
    with pytest.raises(ValueError, match="divisible"):
        pack(torch.zeros(1, 3, dtype=torch.uint8), 2)


def kv_like(num_tokens: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with a few outlier channels, as keys have."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(num_tokens, head_dim, generator=generator)
    rows[:, :3] *= 12.0
    return rows


def minmax_bound(rows: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """The documented bound: half a step, plus float16 rounding of the minimum and scale."""
    step = (high - low) / ((1 << bits) - 1)
    return 0.5 * step * (1 + 2**-9) + 2**-10 * torch.maximum(low.abs(), high.abs()) + 1e-6


@pytest.mark.parametrize("bits", [2, 4])
def test_channel_codec_error_bound(bits):
    rows = kv_like(96, 16)
    sizes = torch.tensor([32, 32, 20, 12])  # whole groups and ragged ones
    encoded = ChannelCodec(bits).encode(rows, sizes)
    restored = ChannelCodec(bits).decode(encoded, torch.float32)
    group = torch.repeat_interleave(torch.arange(4), sizes)
    low = torch.stack([rows[group == g].amin(0) for g in range(4)])[group]
    high = torch.stack([rows[group == g].amax(0) for g in range(4)])[group]
    assert ((restored - rows).abs() <= minmax_bound(rows, low, high, bits)).all()
    assert encoded.per_token["codes"].shape == (96, 16 * bits // 8)
    assert encoded.per_group["scale"].shape == (4, 16) and encoded.per_group["scale"].dtype == torch.float16


@pytest.mark.parametrize("bits", [2, 4])
def test_token_codec_error_bound(bits):
    rows = kv_like(50, 32)
    codec = TokenCodec(bits, channel_group=16)
    restored = codec.decode(codec.encode(rows), torch.float32)
    grouped = rows.view(50, 2, 16)
    low = grouped.amin(-1, keepdim=True).expand_as(grouped).reshape(50, 32)
    high = grouped.amax(-1, keepdim=True).expand_as(grouped).reshape(50, 32)
    assert ((restored - rows).abs() <= minmax_bound(rows, low, high, bits)).all()


def test_int8_and_fp8_error_bounds():
    rows = kv_like(40, 16)
    amax = rows.abs().amax(-1, keepdim=True)
    int8 = Int8Codec()
    assert ((int8.decode(int8.encode(rows), torch.float32) - rows).abs() <= amax / 254 + amax * 2**-10).all()
    fp8 = Fp8Codec()
    restored = fp8.decode(fp8.encode(rows), torch.float32)
    assert ((restored - rows).abs() <= rows.abs() * 2**-4 + amax * 2**-9).all()
    assert fp8.encode(rows).per_token["codes"].dtype == torch.uint8


def test_zero_rows_and_constant_groups_restore_exactly():
    zeros = torch.zeros(32, 16)
    for codec in (ChannelCodec(2), TokenCodec(4, 16), Int8Codec(), Fp8Codec()):
        encoded = codec.encode(zeros, torch.tensor([32]))
        assert torch.equal(codec.decode(encoded, torch.float32), zeros), type(codec).__name__
    constant_channels = torch.zeros(32, 16)
    constant_channels[:, 3] = 2.5  # each channel constant over the group's tokens: a zero scale
    codec = ChannelCodec(2)
    assert torch.equal(
        codec.decode(codec.encode(constant_channels, torch.tensor([32])), torch.float32), constant_channels
    )


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("kivi", {"bits": 3}, "2 or 4 bits, got 3"),
        ("kivi4", {"group_size": 48}, "must divide residual_length 128"),
        ("kivi9", {}, "unknown quantizer 'kivi9'; choose one of: none, kivi2, kivi4, int8, fp8"),
        ("int8", {"group_size": 4}, "bad option for quantizer 'int8'"),
        ("fp8", {"residual_length": -1}, "residual_length must be >= 0"),
    ],
)
def test_bad_quantizer_configs_are_clear(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_quantizer(name, **options)


def test_options_in_the_name():
    quantizer = make_quantizer("kivi2:sink_tokens=0:group_size=64")
    assert quantizer.sink_tokens == 0 and quantizer.group_size == 64 and quantizer.name == "kivi2"
    with pytest.raises(ValueError, match="name=integer pairs"):
        make_quantizer("kivi2:sinks")


def test_head_dim_the_codec_cannot_hold():
    with pytest.raises(ValueError, match="value group size"):
        make_quantizer("kivi4", value_group_size=24).check_head_dim(64)
