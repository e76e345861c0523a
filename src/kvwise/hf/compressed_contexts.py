"""Compress a document once, reuse it many times: compressed contexts stored in a tier.

    contexts = CompressedContexts(DiskTier("/var/cache/kvwise"), tenant="alice")
    cache = contexts.get_or_compress(model, doc_ids, "kvzip", 0.75, quant="kivi4", tokenizer=tokenizer)
    model.generate(torch.cat([doc_ids, question_ids], 1), cache=cache, max_new_tokens=32)

Compressed KV is private to its request, except a context compressed query-agnostically: that
one may be cached, under a key that includes the policy, the ratio and the quantizer (and the
model, the tenant and the KV dtype), so a context compressed one way is never served for
another. The stored state is a safetensors blob (no pickle), and a hit is confirmed by comparing
the context's tokens. Each load builds a fresh cache, since generation appends to it.
"""

from __future__ import annotations

import safetensors.torch
import torch

from kvwise.core.hashing import Namespace, compressed_key
from kvwise.hf.cache import KVWiseCache
from kvwise.hf.geometry import kv_geometry
from kvwise.hf.layer import CompressingLayer
from kvwise.kv.codec import Encoded
from kvwise.kv.quantizer import make_quantizer
from kvwise.kv.store import QuantizedChunk
from kvwise.policies.registry import make_policy
from kvwise.tiers.base import Tier
from kvwise.util.secret_keys import namespace_key as default_namespace_key

STORE_FIELDS = (
    "residual_keys",
    "residual_values",
    "residual_lengths",
    "quantized_lengths",
    "sink_keys",
    "sink_values",
    "sink_lengths",
    "key_groups",
    "value_groups",
)


class CompressedContexts:
    def __init__(self, tier: Tier, tenant: str = "default", shared: bool = False, namespace_key: bytes | None = None):
        """namespace_key: keys the entries' names (default: the key file under $KVWISE_HOME/secrets)."""
        self.tier, self.tenant, self.shared = tier, tenant, shared
        self.secret = default_namespace_key(namespace_key)
        self.hits = self.misses = 0

    def key(self, model, context_ids: torch.Tensor, policy, ratio: float, quant, **policy_kwargs) -> bytes:
        """policy: a name (with `policy_kwargs`) or a Policy; its hyperparameters are part of the key."""
        shape = kv_geometry(model)
        policy = make_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy
        namespace = Namespace(shape.model_id, self.tenant, str(shape.dtype), self.secret)
        namespace = namespace.shared() if self.shared else namespace
        return compressed_key(namespace, f"{quant_label(quant)}/{policy!r}@{ratio}", context_ids.flatten().tolist())

    def save(self, cache: KVWiseCache, context_ids: torch.Tensor) -> bool:
        key = self.key(cache.model, context_ids, cache.policy, cache.compression_ratio, cache.quantizer)
        state = cache_state(cache)
        state["context_ids"] = context_ids.detach().cpu().to(torch.int64)
        blob = safetensors.torch.save(
            {name: tensor.detach().cpu().contiguous().clone() for name, tensor in state.items()}
        )
        return self.tier.put(key, torch.frombuffer(bytearray(blob), dtype=torch.uint8))

    def load(self, model, context_ids, policy: str, ratio: float, quant=None, tokenizer=None, **policy_kwargs):
        """A fresh KVWiseCache holding the stored compressed context, or None on a miss."""
        stored = self.tier.get(self.key(model, context_ids, policy, ratio, quant, **policy_kwargs))
        if stored is None:
            self.misses += 1
            return None
        state = safetensors.torch.load(stored.numpy().tobytes())
        if not torch.equal(state.pop("context_ids"), context_ids.detach().cpu().to(torch.int64)):
            self.misses += 1  # same hash, other tokens: never serve it
            return None
        cache = KVWiseCache(model, policy, ratio, tokenizer=tokenizer, quant=quant, **policy_kwargs)
        restore_cache_state(cache, state, model.device)
        self.hits += 1
        return cache

    def get_or_compress(self, model, context_ids, policy: str, ratio: float, quant=None, tokenizer=None, **kwargs):
        cache = self.load(model, context_ids, policy, ratio, quant, tokenizer, **kwargs)
        if cache is None:
            cache = KVWiseCache(model, policy, ratio, tokenizer=tokenizer, quant=quant, **kwargs)
            cache.compress_context(context_ids)
            self.save(cache, context_ids)
        return cache


def quant_label(quant) -> str:
    """Every setting of a quantizer that changes what is stored."""
    quantizer = make_quantizer(quant)
    return "none" if quantizer is None else quantizer.spec


def cache_state(cache: KVWiseCache) -> dict[str, torch.Tensor]:
    """Every tensor a compressed KVWiseCache holds, by name: each full-attention layer's store, and
    each sliding-window layer's window as transformers holds it (never compressed)."""
    state = {}
    for layer_idx, layer in enumerate(cache.layers):
        if isinstance(layer, CompressingLayer) or not layer.is_initialized:
            continue
        prefix = f"window.{layer_idx}."
        state[prefix + "keys"], state[prefix + "values"] = layer.keys, layer.values
        state[prefix + "cumulative_length"] = torch.tensor([layer.cumulative_length])
    for index, layer in enumerate(cache.compressing_layers):
        prefix, store = f"{index}.", layer.store
        state[prefix + "seen_tokens"] = torch.tensor([layer.seen_tokens])
        if layer.positions is not None:
            state[prefix + "positions"] = layer.positions
        for name, stat in layer.stats.items():
            state[f"{prefix}stat.{name}"] = stat
        for name in STORE_FIELDS:
            state[prefix + name] = getattr(store, name)
        base = store.consolidated_base()
        if base is None:
            continue
        for name in ("tokens", "key_groups", "value_groups"):
            state[f"{prefix}base.{name}"] = getattr(base, name)
        for role, encoded in (("keys", base.keys), ("values", base.values)):
            for name, tensor in encoded.per_token.items():
                state[f"{prefix}base.{role}.token.{name}"] = tensor
            for name, tensor in encoded.per_group.items():
                state[f"{prefix}base.{role}.group.{name}"] = tensor
            if encoded.group_sizes is not None:
                state[f"{prefix}base.{role}.group_sizes"] = encoded.group_sizes
    return state


def restore_cache_state(cache: KVWiseCache, state: dict[str, torch.Tensor], device) -> None:
    for layer_idx, layer in enumerate(cache.layers):
        prefix = f"window.{layer_idx}."
        if isinstance(layer, CompressingLayer) or prefix + "keys" not in state:
            continue
        keys, values = state[prefix + "keys"].to(device), state[prefix + "values"].to(device)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layer.cumulative_length = int(state[prefix + "cumulative_length"][0])
    for index, layer in enumerate(cache.compressing_layers):
        prefix = f"{index}."
        keys = state[prefix + "residual_keys"]
        batch, num_kv_heads = state[prefix + "residual_lengths"].shape
        empty = torch.zeros(batch, num_kv_heads, 0, keys.shape[-1], dtype=keys.dtype, device=device)
        layer.lazy_initialization(empty, empty)
        store = layer.store
        for name in STORE_FIELDS:
            setattr(store, name, state[prefix + name].to(device))
        layer.seen_tokens = int(state[prefix + "seen_tokens"][0])
        layer.positions = state[prefix + "positions"].to(device) if prefix + "positions" in state else None
        layer.stats = {
            name.removeprefix(prefix + "stat."): tensor.to(device)
            for name, tensor in state.items()
            if name.startswith(prefix + "stat.")
        }
        if prefix + "base.tokens" in state:
            roles = {role: _encoded(state, f"{prefix}base.{role}.", device) for role in ("keys", "values")}
            counts = [state[f"{prefix}base.{name}"].to(device) for name in ("tokens", "key_groups", "value_groups")]
            store.set_base(QuantizedChunk(roles["keys"], roles["values"], *counts))


def _encoded(state: dict[str, torch.Tensor], prefix: str, device) -> Encoded:
    def collect(kind: str) -> dict[str, torch.Tensor]:
        start = f"{prefix}{kind}."
        return {name.removeprefix(start): t.to(device) for name, t in state.items() if name.startswith(start)}

    sizes = state.get(prefix + "group_sizes")
    return Encoded(collect("token"), collect("group"), None if sizes is None else sizes.to(device))
