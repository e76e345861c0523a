"""One KV memory budget, split between the device pool and host swap.

`--kv-budget-gb` is all the KV memory the engine may use: the device pool, the host swap space and
the quantized stores together. On a CPU machine they are the same RAM, so counting only the pool
would make swapping free. The pool gets POOL_SHARE of it, host swap SWAP_SHARE, and the rest is
headroom for quantized blocks, which live beside the pool.
"""

from __future__ import annotations

from dataclasses import replace

from kvwise.engine.config import CacheConfig
from kvwise.hf.geometry import kv_geometry

POOL_SHARE = 0.70
SWAP_SHARE = 0.20


def token_bytes(model) -> int:
    """KV bytes of one token in the engine's pool: every layer, keys and values, the model's dtype."""
    shape = kv_geometry(model)
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize


def cache_config_for_budget(
    model,
    budget_bytes: int,
    base: CacheConfig | None = None,
    longest_request: int | None = None,
    pool_share: float = POOL_SHARE,
    swap_bytes: int | None = None,
) -> CacheConfig:
    """`base` (default CacheConfig()) with its pool and swap sized from `budget_bytes`; ValueError
    when the pool could not hold `longest_request` tokens (default: the model's context).
    pool_share and swap_bytes: for a budget of device memory alone (CUDA), the pool takes it all
    and host swap is sized apart."""
    base = base or CacheConfig()
    if budget_bytes <= 0:
        raise ValueError(f"the KV budget must be positive, got {budget_bytes} bytes")
    block_bytes = token_bytes(model) * base.block_size
    num_blocks = int(budget_bytes * pool_share) // block_bytes
    if longest_request is None:
        config = model.config.get_text_config(decoder=True)
        longest_request = getattr(config, "max_position_embeddings", None) or 0
    needed = -(-longest_request // base.block_size)
    if num_blocks < max(1, needed):
        least = needed * block_bytes / pool_share
        raise ValueError(
            f"a KV budget of {budget_bytes / 2**30:.3f} GiB gives the pool {num_blocks} blocks of {base.block_size} "
            f"tokens, fewer than the longest request ({longest_request} tokens) needs; "
            f"give at least {least / 2**30:.3f} GiB"
        )
    swap = int(budget_bytes * SWAP_SHARE) if swap_bytes is None else swap_bytes
    return replace(base, num_blocks=num_blocks, swap_space_bytes=swap)


def kv_memory_for_utilization(device, utilization: float) -> int:
    """The KV bytes that keep a CUDA device's memory use under `utilization` of its total, with
    what is already allocated (the weights) counted, as vLLM's --gpu-memory-utilization."""
    import torch

    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("gpu_memory_utilization sizes a CUDA device's memory; on CPU give kv_cache_memory in bytes")
    free, total = torch.cuda.mem_get_info(device)
    allowed = int(utilization * total) - (total - free)
    if allowed <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for the KV cache: "
            f"{(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB are in use already"
        )
    return allowed


def cache_config_for_memory(
    model,
    base: CacheConfig | None = None,
    kv_memory: int | None = None,
    gpu_memory_utilization: float | None = None,
    longest_request: int | None = None,
    swap_bytes: int | None = None,
) -> CacheConfig | None:
    """`base` with its pool sized from one memory knob, or None when neither is given:
    kv_memory, all the KV memory in bytes (pool, host swap and quantized blocks share it), or
    gpu_memory_utilization (CUDA: the device memory left for the pool alone, host swap sized apart:
    `swap_bytes`, default base's). The one sizing `LLM` and `kvwise serve` use."""
    if kv_memory is not None and gpu_memory_utilization is not None:
        raise ValueError("give the KV memory in bytes or a GPU memory utilization, not both")
    base = base or CacheConfig()
    if gpu_memory_utilization is not None:
        device_bytes = kv_memory_for_utilization(model.device, gpu_memory_utilization)
        swap = base.swap_space_bytes if swap_bytes is None else swap_bytes
        return cache_config_for_budget(model, device_bytes, base, longest_request, pool_share=1.0, swap_bytes=swap)
    if kv_memory is not None:
        return cache_config_for_budget(model, kv_memory, base, longest_request, swap_bytes=swap_bytes)
    return None
