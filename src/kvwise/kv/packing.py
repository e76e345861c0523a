"""Bit-packing of small integer codes into uint8: four 2-bit or two 4-bit codes per byte."""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 4, 8)


def codes_per_byte(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"codes are packed at 2, 4 or 8 bits, got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes along the last axis; the first code of each byte sits in its low bits.

    Args:
        codes: [..., width] uint8, every value < 2**bits; width divisible by 8 // bits.
    Returns:
        [..., width * bits // 8] uint8.
    """
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return codes.to(torch.uint8)
    width = codes.shape[-1]
    if width % per_byte:
        raise ValueError(f"{bits}-bit packing needs a width divisible by {per_byte}, got {width}")
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], width // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: [..., packed_width] uint8 -> [..., packed_width * 8 // bits] uint8."""
    per_byte = codes_per_byte(bits)
    if per_byte == 1:
        return packed
    mask = (1 << bits) - 1
    codes = torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=-1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
