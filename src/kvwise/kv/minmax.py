"""KIVI's asymmetric min/max codecs (arXiv 2402.02750): keys per channel, values per token.

For a group of numbers with minimum m and maximum M, b-bit codes are round((x - m) / s) with
s = (M - m) / (2^b - 1), and x is restored as code * s + m. Scale and minimum are stored in
16 bits and rounded *before* the codes are computed, so the restore uses exactly what the codes
were computed against. Error bound per element: |x - x'| <= s / 2 + (rounding of m), where the
rounding of m to float16 is at most 2^-11 |m|.
"""

from __future__ import annotations

import torch

from kvwise.kv.codec import METADATA_DTYPE, Codec, Encoded
from kvwise.kv.packing import codes_per_byte, pack, unpack


def _codes(rows: torch.Tensor, minimum: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes for `rows` against broadcastable `minimum` and `scale` (float32), as uint8."""
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((rows - minimum) / safe_scale).clamp_(0, (1 << bits) - 1)
    return codes.to(torch.uint8)


def _min_and_scale(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit minimum and scale for groups spanning [low, high]."""
    minimum = low.to(METADATA_DTYPE)
    scale = ((high - minimum.float()) / ((1 << bits) - 1)).to(METADATA_DTYPE)
    return minimum, scale


class ChannelCodec(Codec):
    """Per-channel codes, grouped along tokens: KIVI's key quantization.

    Outlier channels of keys get their own range. Every run of consecutive tokens of one head
    (a group, normally `group_size` tokens) shares one minimum and scale per channel.

    Encoded: codes [num_tokens, head_dim * bits / 8] uint8; per group: min, scale [num_groups, head_dim] float16.
    """

    groups_tokens = True

    def __init__(self, bits: int):
        codes_per_byte(bits)
        self.bits = bits

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % codes_per_byte(self.bits):
            raise ValueError(
                f"{self.bits}-bit keys need head_dim divisible by {codes_per_byte(self.bits)}, got {head_dim}"
            )

    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        if group_sizes is None:
            raise ValueError("ChannelCodec.encode needs group_sizes")
        rows = rows.float()
        num_groups, head_dim = group_sizes.shape[0], rows.shape[1]
        sizes = group_sizes.long()
        if bool((sizes == sizes[0]).all()):  # the common case: whole groups, no scatter needed
            grouped = rows.view(num_groups, int(sizes[0]), head_dim)
            low, high = grouped.amin(dim=1), grouped.amax(dim=1)
        else:
            group_of_row = torch.repeat_interleave(torch.arange(num_groups, device=rows.device), sizes)
            index = group_of_row[:, None].expand_as(rows)
            low = rows.new_zeros(num_groups, head_dim).scatter_reduce(0, index, rows, "amin", include_self=False)
            high = rows.new_zeros(num_groups, head_dim).scatter_reduce(0, index, rows, "amax", include_self=False)
        minimum, scale = _min_and_scale(low, high, self.bits)
        group_of_row = torch.repeat_interleave(torch.arange(num_groups, device=rows.device), sizes)
        codes = _codes(rows, minimum.float()[group_of_row], scale.float()[group_of_row], self.bits)
        return Encoded(
            per_token={"codes": pack(codes, self.bits)},
            per_group={"min": minimum, "scale": scale},
            group_sizes=group_sizes.to(torch.int16),
        )

    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        sizes = encoded.group_sizes.long()
        codes = unpack(encoded.per_token["codes"], self.bits).float()
        scale = encoded.per_group["scale"].float().repeat_interleave(sizes, dim=0)
        minimum = encoded.per_group["min"].float().repeat_interleave(sizes, dim=0)
        return torch.addcmul(minimum, codes, scale).to(dtype)


class TokenCodec(Codec):
    """Per-token codes, grouped along channels: KIVI's value quantization.

    Encoded: codes [num_tokens, head_dim * bits / 8] uint8; per token: min, scale
    [num_tokens, head_dim / channel_group] float16.
    """

    def __init__(self, bits: int, channel_group: int):
        codes_per_byte(bits)
        if channel_group < 1:
            raise ValueError(f"the channel group size must be positive, got {channel_group}")
        self.bits, self.channel_group = bits, channel_group

    def _group_width(self, head_dim: int) -> int:
        return min(self.channel_group, head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        width = self._group_width(head_dim)
        if head_dim % width or head_dim % codes_per_byte(self.bits):
            raise ValueError(
                f"{self.bits}-bit values in channel groups of {width} do not fit head_dim {head_dim}; "
                "choose a value group size that divides it"
            )

    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        num_tokens, head_dim = rows.shape
        width = self._group_width(head_dim)
        grouped = rows.float().view(num_tokens, head_dim // width, width)
        minimum, scale = _min_and_scale(grouped.amin(dim=-1), grouped.amax(dim=-1), self.bits)
        codes = _codes(grouped, minimum.float()[..., None], scale.float()[..., None], self.bits)
        return Encoded(
            per_token={"codes": pack(codes.view(num_tokens, head_dim), self.bits), "min": minimum, "scale": scale}
        )

    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(encoded.per_token["codes"], self.bits).float()
        num_tokens, head_dim = codes.shape
        width = self._group_width(head_dim)
        grouped = codes.view(num_tokens, head_dim // width, width)
        scale = encoded.per_token["scale"].float()[..., None]
        minimum = encoded.per_token["min"].float()[..., None]
        return torch.addcmul(minimum, grouped, scale).view(num_tokens, head_dim).to(dtype)
