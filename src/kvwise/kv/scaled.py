"""Symmetric per-token codecs: INT8 and FP8 (e4m3).

Both keep one float16 scale per token of each head (so every head has its own scales) and no
zero point. INT8 rounds x / s to an integer in [-127, 127] with s = max|x| / 127, so the error
is at most s / 2 per element, plus 2^-11 max|x| from storing s in float16. FP8 stores x / s
as float8 e4m3 with s = max|x| / 448, whose 3-bit mantissa gives a relative error of at most
2^-4 per element (plus s * 2^-9 near zero).

Encoded: codes [num_tokens, head_dim] uint8 (int8 or float8 bit patterns);
         per token: scale [num_tokens, 1] float16.
"""

from __future__ import annotations

import torch

from kvwise.kv.codec import METADATA_DTYPE, Codec, Encoded

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def _scales(rows: torch.Tensor, top: float) -> torch.Tensor:
    """Per-row float16 scales mapping each row's largest magnitude to `top`: [num_tokens, 1]."""
    return (rows.abs().amax(dim=-1, keepdim=True) / top).to(METADATA_DTYPE)


def _divide(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float()
    return rows / torch.where(scale > 0, scale, torch.ones_like(scale))


class Int8Codec(Codec):
    """INT8, symmetric, one scale per token."""

    bits = 8

    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        rows = rows.float()
        scale = _scales(rows, 127.0)
        codes = torch.round(_divide(rows, scale)).clamp_(-127, 127).to(torch.int8)
        return Encoded(per_token={"codes": codes.view(torch.uint8), "scale": scale})

    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        codes = encoded.per_token["codes"].view(torch.int8).float()
        return (codes * encoded.per_token["scale"].float()).to(dtype)


class Fp8Codec(Codec):
    """FP8 e4m3, one scale per token of each head."""

    bits = 8

    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        rows = rows.float()
        scale = _scales(rows, FP8_MAX)
        codes = _divide(rows, scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Encoded(per_token={"codes": codes.view(torch.uint8), "scale": scale})

    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        codes = encoded.per_token["codes"]
        # A 256-entry table beats torch's float8 -> float32 cast on CPU by about a third.
        values = _fp8_table(codes.device)[codes.long()]
        return (values * encoded.per_token["scale"].float()).to(dtype)


_FP8_TABLES: dict[torch.device, torch.Tensor] = {}


def _fp8_table(device: torch.device) -> torch.Tensor:
    """float32 value of every e4m3 bit pattern (NaN patterns, never written, read as 0)."""
    if device not in _FP8_TABLES:
        patterns = torch.arange(256, dtype=torch.uint8, device=device)
        _FP8_TABLES[device] = torch.nan_to_num(patterns.view(torch.float8_e4m3fn).float(), nan=0.0)
    return _FP8_TABLES[device]
