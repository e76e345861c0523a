"""Hand each attention layer's input (its hidden states) to the kvwise cache that asks for it.

A policy that scores tokens from hidden states (kvzap's surrogate) needs what the attention
module received, which the attention function never sees: it gets queries and keys, already
projected and rotated. A forward pre-hook on every attention module reads `hidden_states` from
the call and hands it to whoever holds the KV of that forward, if it asks for it
(`wants_attention_inputs`, then `store_attention_input(layer_idx, hidden_states)`): the call's
cache (`KVWiseCache`), or the serving engine's step layout attached to the module. For anything
else the hook does nothing.
"""

from __future__ import annotations

import torch

_INSTALLED = "_kvwise_attention_input_hooks"


def attention_modules(model) -> list[torch.nn.Module]:
    """The model's attention modules: those with an integer `layer_idx` whose class is an attention."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and "Attention" in type(module).__name__
    ]


def install_attention_input_hooks(model) -> None:
    """Idempotent. Raises ValueError when the model has no attention module kvwise can find."""
    if getattr(model, _INSTALLED, False):
        return
    modules = attention_modules(model)
    if not modules:
        raise ValueError(
            f"{type(model).__name__} has no attention module with a layer_idx: policies that score "
            "hidden states (kvzap) cannot read them"
        )
    for module in modules:
        module.register_forward_pre_hook(_store_input, with_kwargs=True)
    setattr(model, _INSTALLED, True)


ENGINE_STEP_ATTRIBUTE = "_kvwise_step"  # the engine's StepLayout on an attention module during a forward


def _store_input(module, args, kwargs):
    holder = kwargs.get("cache")
    if holder is None:  # an empty cache may be falsy (len 0): test for None, never truth
        holder = kwargs.get("past_key_values")
    if holder is None:
        holder = getattr(module, ENGINE_STEP_ATTRIBUTE, None)
    if not getattr(holder, "wants_attention_inputs", False):
        return None
    # [batch, query_len, hidden_size]: the input of this layer's q/k/v projections
    holder.store_attention_input(module.layer_idx, kwargs.get("hidden_states", args[0] if args else None))
    return None
