"""What a transformers model's KV looks like, read once from its config: one place for every user."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    model_id: str  # the model's name or path: part of every block key's namespace


def kv_geometry(model) -> KVGeometry:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    model_id = str(getattr(config, "_name_or_path", "") or type(model).__name__)
    dtype = next(model.parameters()).dtype
    return KVGeometry(config.num_hidden_layers, num_kv_heads, head_dim, dtype, model_id)


def paged_storage_for(model, num_blocks: int, block_size: int):
    """A PagedKVStorage shaped for `model`, on its device, in its dtype."""
    from kvwise.kv.paged import PagedKVStorage

    shape = kv_geometry(model)
    return PagedKVStorage(
        shape.num_layers, num_blocks, block_size, shape.num_kv_heads, shape.head_dim, shape.dtype, model.device
    )
