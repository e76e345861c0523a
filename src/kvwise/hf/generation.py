"""A minimal greedy continuation over a prefilled cache (the benchmarks' decode loop)."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_continue(model, cache, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Feed `input_ids` [batch, n] after what `cache` holds, then decode greedily.

    Returns the new token ids: [batch, max_new_tokens].
    """
    generated = []
    next_ids = input_ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=next_ids, cache=cache, use_cache=True, logits_to_keep=1).logits
        next_ids = logits[:, -1].argmax(dim=-1, keepdim=True)
        generated.append(next_ids)
    return torch.cat(generated, dim=1)
