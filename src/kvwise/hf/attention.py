"""The `kvwise` attention function, registered through transformers' `AttentionInterface`.

transformers builds one attention mask per layer type, sized from the first layer. A compressed
cache breaks that assumption: layers keep different numbers of tokens, and with Ada-KV so do the
heads of one layer (transformers #35168). This function therefore builds its own mask from the
cache layer's per-head validity, and it is also where a layer is compressed: scoring needs the
queries, and only the attention function sees them.

For any other cache (or none) it behaves like transformers' SDPA attention.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

ATTENTION_NAME = "kvwise"

log = logging.getLogger("kvwise")


def register_attention() -> None:
    """Register `kvwise` with transformers. Idempotent; called when a model or cache is set up."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kvwise_attention)
    # Boolean SDPA masks: the padding of new tokens is read from them.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def attention_implementation(model) -> str | None:
    """The attention function `model` uses now. transformers keeps it in a private config field
    with no public getter (`set_attn_implementation` is the public setter); read in this one place."""
    return model.config._attn_implementation  # noqa: SLF001  (transformers' only record of it)


def use_kvwise_attention(model) -> str | None:
    """Switch `model` to the kvwise attention function (a no-op when it already uses it); returns
    the implementation it used before (for `KVWiseCache.restore_attention`)."""
    register_attention()
    previous = attention_implementation(model)
    if previous != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
        log.info(
            "switched %s to kvwise attention (was %s; cache.restore_attention() switches back)",
            type(model).__name__,
            previous,
        )
    return previous


def kvwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer.

    Args:
        query: [batch, num_heads, query_len, head_dim].
        key, value: [batch, num_kv_heads, kv_len, head_dim]; from a kvwise layer, the first
            `kv_len - query_len` slots are its cache padded per head, the rest the new tokens.
        attention_mask: bool [batch, 1, query_len, logical_kv_len] or None (plain causal).
    Returns:
        ([batch, query_len, num_heads, head_dim], None)
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    step = getattr(key, "kvwise_step", None)
    if step is None:
        is_causal = attention_mask is None and query.shape[2] > 1 and getattr(module, "is_causal", True)
        output = attend(query, key, value, attention_mask, scaling, softcap, is_causal=is_causal)
        return output.transpose(1, 2).contiguous(), None

    query_len = query.shape[2]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    tail_mask = None if attention_mask is None else attention_mask[..., -query_len:]
    # A new key that no query may see is padding; it is dropped, never stored.
    new_valid = None if tail_mask is None else tail_mask.any(dim=-2)[:, 0]
    if step.prefix_len == 0:
        output = attend(query, key, value, tail_mask, scaling, softcap, is_causal=tail_mask is None and query_len > 1)
    else:
        key, value, prefix_valid = step.layer.keys_for_attention(step, query)
        if bool(prefix_valid.all()):
            # Every head sees every cached slot: one mask for all heads, and SDPA's GQA path.
            mask = shared_mask(prefix_valid.shape[-1], tail_mask, query_len, query.device)
            output = attend(query, key, value, mask, scaling, softcap, is_causal=False)
        else:
            mask = grouped_mask(prefix_valid, tail_mask, query_len, query.shape[1] // key.shape[1])
            output = attend_grouped(query, key, value, mask, scaling, softcap)
    step.layer.after_attention(step, query, new_valid, scaling)
    return output.transpose(1, 2).contiguous(), None


def shared_mask(prefix_len: int, tail_mask: torch.Tensor | None, query_len: int, device) -> torch.Tensor:
    """[batch or 1, 1, query_len, prefix_len + query_len] bool: the whole prefix, then `tail_mask`."""
    if tail_mask is None:
        tail_mask = torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril()[None, None]
    prefix = torch.ones(*tail_mask.shape[:3], prefix_len, dtype=torch.bool, device=device)
    return torch.cat([prefix, tail_mask], dim=-1)


def grouped_mask(
    prefix_valid: torch.Tensor, tail_mask: torch.Tensor | None, query_len: int, group_size: int
) -> torch.Tensor:
    """Mask for attention with the GQA group folded into the query axis.

    Args:
        prefix_valid: [batch, num_kv_heads, prefix_len] bool, per-head validity of cached slots.
        tail_mask: [batch, 1, query_len, query_len] bool among the new tokens, or None for causal.
    Returns:
        [batch, num_kv_heads, group_size * query_len, prefix_len + query_len] bool.
    """
    batch, num_kv_heads, prefix_len = prefix_valid.shape
    device = prefix_valid.device
    if tail_mask is None:
        tail_mask = torch.ones(query_len, query_len, dtype=torch.bool, device=device).tril()[None, None]
    rows = group_size * query_len
    tail = tail_mask[:, :, None].expand(batch, num_kv_heads, group_size, query_len, query_len)
    prefix = prefix_valid[:, :, None, :].expand(batch, num_kv_heads, rows, prefix_len)
    return torch.cat([prefix, tail.reshape(batch, num_kv_heads, rows, query_len)], dim=-1)


def attend_grouped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention with per-KV-head masks, without expanding keys by `repeat_kv`.

    Args:
        query: [batch, num_heads, query_len, head_dim].
        key, value: [batch, num_kv_heads, kv_len, head_dim].
        mask: [batch, num_kv_heads, group_size * query_len, kv_len] bool.
    Returns:
        [batch, num_heads, query_len, head_dim]
    """
    batch, num_heads, query_len, head_dim = query.shape
    num_kv_heads = key.shape[1]
    folded = query.reshape(batch, num_kv_heads, (num_heads // num_kv_heads) * query_len, head_dim)
    output = attend(folded, key, value, mask, scaling, softcap, is_causal=False)
    return output.reshape(batch, num_heads, query_len, value.shape[-1])


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
    is_causal: bool,
) -> torch.Tensor:
    """SDPA, or explicit math when logits are soft-capped (Gemma 2). Shapes as in `attend_grouped`."""
    if mask is not None and query.shape[2] > 1:
        # A row with nothing to attend to (a padding query) would give NaN; let it see everything.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    group_size = query.shape[1] // key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=group_size > 1
        )
    if group_size > 1:
        key = key.repeat_interleave(group_size, dim=1)
        value = value.repeat_interleave(group_size, dim=1)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling
    logits = torch.tanh(logits / softcap) * softcap
    if is_causal:
        mask = torch.ones(logits.shape[-2:], dtype=torch.bool, device=logits.device).tril(
            logits.shape[-1] - logits.shape[-2]
        )
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits.float(), dim=-1).to(value.dtype)
    return torch.matmul(probs, value)
