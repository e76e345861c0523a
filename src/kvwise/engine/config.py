"""`CacheConfig`: the engine's memory and batching settings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 2048
    # tokens computed per step (prefill chunks + decodes), vLLM's max_num_batched_tokens. With the
    # CPU decode kernel, 1536-2048 ran the throughput workload ~8% faster than 1024 (4096: ~4%)
    token_budget: int = 2048
    max_running: int = 64
    prefix_caching: bool = True
    # host memory for preempted requests' KV (vLLM's swap space); 0: preemption recomputes
    swap_space_bytes: int = 4 << 30
    # prefix-cache blocks one tenant may hold (None: no limit); a tenant at its quota evicts its
    # own prefixes first, so one tenant's traffic cannot flush everyone else's cache
    prefix_quota_blocks: int | None = None
    # without an explicit quota, each tenant holding prefix blocks may hold an equal share of the
    # pool: eviction under pressure takes from the tenant over its share first
    fair_prefix_shares: bool = True
    # write newly computed prefix blocks to the shared tiers (Redis) at once, not only at eviction,
    # so other servers on the same Redis reuse them (replicas behind one router do)
    publish_prefixes: bool = False

    def __post_init__(self):
        for name in ("block_size", "num_blocks", "token_budget", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefix_quota_blocks is not None and self.prefix_quota_blocks < 1:
            raise ValueError(f"prefix_quota_blocks must be positive or None, got {self.prefix_quota_blocks}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
