"""transformers' own quantized KV caches, the peers of `kvwise bench ppl`.

`QuantizedCache` (transformers 5.24) with the optimum-quanto or HQQ backend. Their bytes are
counted from the tensors they really hold, walking quantized tensor subclasses down to plain
tensors, so packed codes count as packed.
"""

from __future__ import annotations

import importlib.util

import torch

BACKEND_PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}


def backend_available(backend: str) -> bool:
    package = BACKEND_PACKAGES[backend]
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def make_hf_quantized_cache(model, backend: str, nbits: int, axis_key: int | None = None):
    """A transformers `QuantizedCache`; raises ValueError naming the package when it is missing."""
    if backend not in BACKEND_PACKAGES:
        raise ValueError(f"unknown HF cache backend {backend!r}; choose one of: {', '.join(BACKEND_PACKAGES)}")
    if not backend_available(backend):
        raise ValueError(f"the {backend} backend needs `pip install {BACKEND_PACKAGES[backend].replace('.', '-')}`")
    from transformers import QuantizedCache

    options = {"nbits": nbits}
    if axis_key is not None:
        options["axis_key"] = axis_key
    return QuantizedCache(backend=backend, config=model.config, **options)


def held_bytes(value) -> int:
    """Bytes of every plain tensor reachable from `value` (tensor subclasses are flattened)."""
    if isinstance(value, torch.Tensor):
        if type(value) is torch.Tensor or not hasattr(value, "__tensor_flatten__"):
            return value.numel() * value.element_size()
        names, _ = value.__tensor_flatten__()
        return sum(held_bytes(getattr(value, name)) for name in names)
    if isinstance(value, dict):
        return sum(held_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(held_bytes(item) for item in value)
    return 0


def hf_cache_bytes(cache) -> int:
    """Bytes a transformers quantized cache holds: quantized states and the residual."""
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            total += held_bytes(getattr(layer, name, None))
    return total
