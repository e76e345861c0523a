"""Rows kept as 16-bit floats: the store of a low-rank codec's coefficients when nothing quantizes
them (`lowrank:r=16` alone)."""

from __future__ import annotations

import torch

from kvwise.kv.codec import Codec, Encoded


class Float16Codec(Codec):
    """Encoded: codes [num_tokens, head_dim * 2] uint8 (the float16 bytes); no metadata."""

    bits = 16

    def encode(self, rows: torch.Tensor, group_sizes: torch.Tensor | None = None) -> Encoded:
        return Encoded(per_token={"codes": rows.to(torch.float16).contiguous().view(torch.uint8)})

    def decode(self, encoded: Encoded, dtype: torch.dtype) -> torch.Tensor:
        return encoded.per_token["codes"].view(torch.float16).to(dtype)
