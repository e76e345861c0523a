"""Moving RoPE-rotated queries to later positions, for scorers that simulate future queries."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch


def _rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def query_rotator(model) -> Callable[[torch.Tensor, int, int], torch.Tensor] | None:
    """A function `(queries, delta, layer_idx) -> queries` rotated `delta` positions further.

    RoPE rotations compose, so R(p + delta) q = R(delta) R(p) q. The rotation is the model's own:
    its rotary module gives cos/sin (per layer type where the model has several, as Gemma 3's
    local and global bases), and its modeling file's `apply_rotary_pos_emb` applies them, so
    interleaved (Cohere) and partial (GPT-NeoX, StableLM, Phi-3) rotary embeddings move right.
    Returns None when the model has no `rotary_emb` module; callers then use the queries unshifted.
    """
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        return None
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
    apply = _model_apply_rotary(model)

    def rotate(queries: torch.Tensor, delta: int, layer_idx: int = 0) -> torch.Tensor:
        """queries: [batch, num_heads, rows, head_dim]."""
        position_ids = torch.tensor([[delta]], device=queries.device)
        kwargs = {"layer_type": layer_types[layer_idx]} if takes_layer_type and layer_types else {}
        cos, sin = rotary(queries, position_ids=position_ids, **kwargs)  # [1, 1, rotary_dim]
        cos, sin = cos.to(queries.dtype), sin.to(queries.dtype)
        if apply is not None:
            rotated, _ = apply(queries, queries, cos, sin)
            return rotated
        if cos.shape[-1] != queries.shape[-1]:
            return queries  # partial rotary without the model's own function: leave them
        return queries * cos[:, None] + _rotate_half(queries) * sin[:, None]

    return rotate


def _model_apply_rotary(model):
    """`apply_rotary_pos_emb(q, k, cos, sin)` of the model's modeling file, or None."""
    for module in model.modules():
        if getattr(module, "layer_idx", None) is not None and "Attention" in type(module).__name__:
            function = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
            if callable(function):
                return function
    return None
