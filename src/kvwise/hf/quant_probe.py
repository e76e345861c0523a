"""The attention-output error of quantization, probed on the step that quantized tokens.

Once a token is quantized its full-precision keys and values are gone, so the error cannot be
measured against full precision later without keeping a full copy (which would defeat the
point). It is measured at the one moment both exist: when a commit quantizes tokens, the step's
last query attends over the cache as stored (restored rows) and over the same cache with those
rows at full precision. Rows quantized by earlier steps enter both sides restored. When a whole
context is quantized at once (the first fill, or `compress_context`), this is the exact error
against a full-precision cache.
"""

from __future__ import annotations

import torch

from kvwise.hf.attention import attend_grouped
from kvwise.kv.store import Spill


def attention_error_of_spill(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, spill: Spill, query: torch.Tensor, scaling: float
) -> float:
    """Relative L2 error of the attention output caused by this spill.

    Args:
        keys, values: [batch, num_kv_heads, slots, head_dim], the step's rows before quantization.
        keep: [batch, num_kv_heads, slots] bool, the slots the step kept.
        spill: which of those slots were quantized, and their restored rows.
        query: [batch, num_heads, 1, head_dim], the step's last query.
    """
    restored_keys, restored_values = keys.clone(), values.clone()
    restored_keys[spill.slots] = spill.keys
    restored_values[spill.slots] = spill.values
    group_size = query.shape[1] // keys.shape[1]
    mask = keep[:, :, None, :].expand(-1, -1, group_size, -1)
    reference = attend_grouped(query, keys, values, mask, scaling, None).float()
    quantized = attend_grouped(query, restored_keys, restored_values, mask, scaling, None).float()
    return float((quantized - reference).norm() / reference.norm().clamp(min=1e-12))
