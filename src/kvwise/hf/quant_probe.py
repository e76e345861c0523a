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

from kvwise.kv.store import Spill


def attention_error_of_spill(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, spill: Spill, query: torch.Tensor, scaling: float
) -> float:
    """Relative L2 error of the attention output caused by this spill.

    Only the quantized slots differ between the two sides, so their logits and values are
    patched in rather than the whole cache copied. (Logit soft-capping is left out: this is a
    quality signal, not the model's output.)

    Args:
        keys, values: [batch, num_kv_heads, slots, head_dim], the step's rows before quantization.
        keep: [batch, num_kv_heads, slots] bool, the slots the step kept.
        spill: which of those slots were quantized, and their restored rows.
        query: [batch, num_heads, 1, head_dim], the step's last query.
    """
    batch, num_kv_heads, _, head_dim = keys.shape
    queries = query.reshape(batch, num_kv_heads, -1, head_dim).float()  # [batch, kv_heads, group, head_dim]
    logits = torch.matmul(queries, keys.float().transpose(-1, -2)) * scaling  # [batch, kv_heads, group, slots]
    logits = logits.masked_fill(~keep[:, :, None, :], float("-inf"))
    b, h, s = spill.slots.nonzero(as_tuple=True)
    quantized_logits = logits.clone()
    quantized_logits[b, h, :, s] = (queries[b, h] * spill.keys.float()[:, None, :]).sum(dim=-1) * scaling
    values_float = values.float()
    reference = torch.matmul(torch.softmax(logits, dim=-1), values_float)
    probs = torch.softmax(quantized_logits, dim=-1)
    quantized = torch.matmul(probs, values_float)
    value_change = spill.values.float() - values_float[b, h, s]  # [num_spilled, head_dim]
    quantized.index_put_((b, h), probs[b, h, :, s][..., None] * value_change[:, None, :], accumulate=True)
    return float((quantized - reference).norm() / reference.norm().clamp(min=1e-12))
