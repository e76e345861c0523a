"""Moving RoPE-rotated queries to later positions, for scorers that simulate future queries."""

from __future__ import annotations

from collections.abc import Callable

import torch


def _rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first, second = tensor.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def query_rotator(model) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
    """A function `(queries, delta) -> queries` rotated `delta` positions further.

    RoPE rotations compose, so R(p + delta) q = R(delta) R(p) q. This holds for the rotate-half
    form used by Llama, Qwen2, Mistral and Gemma; returns None when the model has no such
    `rotary_emb` module, and callers then use the queries unshifted.
    """
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        return None

    def rotate(queries: torch.Tensor, delta: int) -> torch.Tensor:
        """queries: [batch, num_heads, rows, head_dim]."""
        position_ids = torch.tensor([[delta]], device=queries.device)
        cos, sin = rotary(queries, position_ids=position_ids)  # [1, 1, head_dim]
        if cos.shape[-1] != queries.shape[-1]:
            return queries  # partial rotary: leave the queries as they are
        cos, sin = cos[:, None].to(queries.dtype), sin[:, None].to(queries.dtype)
        return queries * cos + _rotate_half(queries) * sin

    return rotate
